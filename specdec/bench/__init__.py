"""Benchmarks and the decision tool: `specdec bench` (harness, prompts, peers, report, plots) and
`specdec advise` (cost model on the user's own prompts). Modules import lazily; nothing heavy here."""
