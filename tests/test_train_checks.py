"""The training pipeline's checks: a resumed run keeps its settings, its time budget and its data; a damaged
checkpoint, shard or head, data of another model and bad draft layers are one-line errors; a fine-tune whose
held-out prompts its starting head may have trained on is warned."""
from __future__ import annotations

import json

import pytest
import torch


def test_a_resumed_run_keeps_its_settings_budget_and_data_checks(dataset, tmp_path):
    """A checkpoint holds the settings it was trained with (another batch size would skip other batches,
    another lr bend the schedule: refused), the steps a time budget cut the run to and the seconds spent
    (a resumed run spends what is left, not a new budget); a checkpoint or shard cut short, data of another
    model and data of other layers are one-line errors."""
    from specdec.config import ConfigError
    from specdec.model.loader import load_model
    from specdec.train.features import read_split
    from specdec.train.trainer import TrainSpec, Trainer

    d, data = dataset
    target = load_model(d, torch.float32, 512)
    spec = TrainSpec(kind="eagle3", data=(str(data),), out=str(tmp_path / "e3"), epochs=4, batch_size=2, warmup=1,
                     draft_vocab_size=40, ckpt_every=1, eval_every=100, save_dtype="float32", max_seconds=3600.0)
    t = Trainer(spec, target, progress=False)
    t.total_steps, t.seconds_before = 3, 3599.99  # as if a budget had cut it to 3 steps, its hour spent
    t.run()
    resumed = Trainer(spec, target, progress=False)
    assert resumed.maybe_resume() and resumed.total_steps == 3 and resumed.seconds_before >= 3599.99
    for change in ({"batch_size": 3}, {"lr": 2e-3}):
        with pytest.raises(ConfigError, match=next(iter(change))):
            Trainer(TrainSpec(**{**spec.__dict__, **change}), target, progress=False).maybe_resume()
    assert Trainer(TrainSpec(**{**spec.__dict__, "max_train_seqs": 2}), target, progress=False).maybe_resume()
    import shutil
    relabeled = tmp_path / "relabeled"  # data of another held-out split: the record would call trained-on prompts unseen
    shutil.copytree(data, relabeled)
    meta = json.loads((data / "meta.json").read_text())
    (relabeled / "meta.json").write_text(json.dumps({**meta, "heldout_prompts": ["0" * 16]}))
    with pytest.raises(ConfigError, match="other held-out prompts"):
        Trainer(TrainSpec(**{**spec.__dict__, "data": (str(relabeled),)}), target, progress=False).maybe_resume()
    ckpt = tmp_path / "e3" / "checkpoint.pt"
    whole = ckpt.read_bytes()
    for damaged in (whole[:100], b"", bytes(len(whole))):  # cut short, empty, zero-filled
        ckpt.write_bytes(damaged)
        with pytest.raises(ConfigError, match="cannot be read"):
            Trainer(spec, target, progress=False).maybe_resume()
    # a shard cut short, data of another model, features of other layers
    cut = tmp_path / "cut"
    shutil.copytree(data, cut)
    shard = sorted((cut / "train").glob("shard-*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:64])
    with pytest.raises(ConfigError, match="cannot be read"):
        read_split(cut / "train")
    for i, change in enumerate(({"hidden_size": 999}, {"aux_layers": [0, 1, 2]})):
        other = tmp_path / f"other{i}"
        shutil.copytree(data, other)
        (other / "meta.json").write_text(json.dumps({**meta, **change}))
        with pytest.raises(ConfigError, match="hidden size 999" if i == 0 else "aux_layers"):
            Trainer(TrainSpec(**{**spec.__dict__, "data": (str(data), str(other))}), target, progress=False)
    # a draft vocabulary past the target's (a size mismatch inside set_vocab), epochs NaN (int(nan) later)
    with pytest.raises(ConfigError, match="more than the target's vocabulary"):
        Trainer(TrainSpec(**{**spec.__dict__, "draft_vocab_size": target.config.vocab_size + 1}), target,
                progress=False)
    with pytest.raises(ConfigError, match="epochs"):
        TrainSpec(**{**spec.__dict__, "epochs": float("nan")})


def test_draft_layers_and_head_fit_are_checked(tiny_dir):
    """train draft-model's --layers (its old default named layer 29 of any target) and a head of another
    model (the medusa proposer and eval-draft's offline path failed in a matmul) are one-line errors."""
    from specdec.cli.train import _draft_layers
    from specdec.config import ConfigError
    from specdec.model.loader import read_config
    from specdec.proposers.head_io import ASSETS, check_head_fits, load_head

    assert _draft_layers(None, 30) == [0, 1, 2, 3, 29] and _draft_layers(None, 4) == [0, 1, 2, 3]
    assert _draft_layers("0,2", 4) == [0, 2]
    for bad in ("0,1,29", "2,1", "a,b", "-1,0"):
        with pytest.raises(ConfigError, match="--layers"):
            _draft_layers(bad, 4)
    tiny = read_config(tiny_dir("llama"))
    for kind in ("medusa", "eagle3"):
        head_dir = next(ASSETS.glob(f"*-{kind}"))
        with pytest.raises(ConfigError, match="trained for hidden"):
            check_head_fits(load_head(head_dir), tiny, head_dir, kind)


def test_a_head_whose_tensors_do_not_match_its_config_is_one_line(tmp_path):
    """A head tensor shaped unlike its config made load_state_dict raise a RuntimeError (a traceback)."""
    import shutil

    from safetensors.torch import load_file, save_file

    from specdec.config import ConfigError
    from specdec.proposers.head_io import ASSETS, load_head

    head = tmp_path / "head"
    shutil.copytree(next(ASSETS.glob("*-eagle3")), head)
    t = load_file(str(head / "model.safetensors"))
    t["fc.weight"] = t["fc.weight"][:, :-1].contiguous()
    save_file(t, str(head / "model.safetensors"))
    with pytest.raises(ConfigError, match="do not match its config"):
        load_head(head)


def test_a_fine_tune_is_warned_when_its_heldout_prompts_may_be_trained_on(dataset, tmp_path):
    """A head records its data's held-out prompt digests; a fine-tune from it on data that holds out those
    prompts runs quietly, one whose held-out prompts the head does not list as held out (or that lists none)
    is warned, and `train data --heldout-from` reads the record (a head without one is one error)."""
    import warnings

    from specdec.cli.train import _heldout_of
    from specdec.config import ConfigError
    from specdec.train.trainer import TrainSpec, Trainer
    from tests.conftest import one_step_eagle3_head

    held = json.loads((dataset[1] / "meta.json").read_text())["heldout_prompts"]
    assert len(held) == 3
    target, spec, _, head_dir = one_step_eagle3_head(dataset, tmp_path)
    assert _heldout_of(head_dir) == tuple(sorted(held))
    tune = TrainSpec(**{**spec.__dict__, "out": str(tmp_path / "tuned"), "init_from": str(head_dir)})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Trainer(tune, target, progress=False)
    config = json.loads((head_dir / "config.json").read_text())
    for record, match in ((held[:2], "1 of the data's 3 held-out prompts are not held out"), (None, "records no")):
        config["specdec"]["training"]["heldout_prompts"] = record
        (head_dir / "config.json").write_text(json.dumps(config))
        with pytest.warns(UserWarning, match=match):
            tuned = Trainer(tune, target, progress=False)
        # its own record: held out from what both were (None where either does not say)
        assert tuned.heldout_prompts == (None if record is None else sorted(set(held) & set(record)))
    with pytest.raises(ConfigError, match="records no held-out prompts"):
        _heldout_of(head_dir)


def test_a_train_sequence_that_begins_with_a_heldout_prompt_is_left_out(monkeypatch):
    """Data directories combined: a train sequence on another directory's held-out prompt is dropped, and
    so is a later turn whose conversation begins with one (it carries that prompt as context); a prompt
    that a held-out one merely begins with is kept."""
    from types import SimpleNamespace as Seq

    from specdec.train import features

    held = [Seq(tokens=[1, 2, 3, 9], prompt_len=3)]
    train = [Seq(tokens=[1, 2, 3, 7, 8, 5, 6], prompt_len=5),  # the held-out prompt, an answer, a new turn
             Seq(tokens=[1, 2, 3, 4], prompt_len=3),  # the held-out prompt itself
             Seq(tokens=[1, 2, 4, 4], prompt_len=3),
             Seq(tokens=[1, 2, 3], prompt_len=2)]
    monkeypatch.setattr(features, "read_split", lambda path, *a: held if path.name == "heldout" else train)
    kept, heldout = features.train_and_heldout(["data"])
    assert heldout == held and kept == train[2:]
