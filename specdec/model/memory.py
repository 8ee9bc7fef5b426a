"""Weights in one arena on transparent huge pages (Linux, CPU).

Decoding streams every weight once per token. On 4 KiB pages that stream takes a TLB miss every
4 KiB; in a 2 MiB-page arena it takes one every 2 MiB. Measured on the 2-core AMD EPYC (one thread,
a cold 460 MB matrix): our matmul kernel 13.8 -> 15.4 GB/s, torch's sum 15.4 -> 18.7 GB/s.
Linux backs an anonymous mapping with huge pages when it is advised (MADV_HUGEPAGE) and
`/sys/kernel/mm/transparent_hugepage/enabled` is `always` or `madvise`; anywhere else this is a no-op.
"""
from __future__ import annotations

import ctypes
import mmap
import sys

import torch

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14
ALIGN = 64


def _madvise_huge(buf: mmap.mmap) -> int | None:
    """Advise huge pages on the 2 MiB-aligned part of buf; its offset, or None if not possible."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    except (OSError, AttributeError, TypeError):
        return None
    offset = (-addr) % HUGE_PAGE
    if libc.madvise(addr + offset, len(buf) - offset, MADV_HUGEPAGE) != 0:
        return None
    return offset


def move_to_huge_pages(model: torch.nn.Module) -> bool:
    """Copy the model's CPU parameters and buffers (packed weights: bf16, int8/int4) into one huge-page
    arena (tied weights stay tied). True if done."""
    if not sys.platform.startswith("linux"):
        return False
    params = {}
    for p in list(model.parameters()) + list(model.buffers()):
        if p.device.type != "cpu" or p.is_meta:
            return False
        params.setdefault(p.data_ptr(), p)  # tied parameters share storage: one copy
    sizes = {ptr: (p.numel() * p.element_size() + ALIGN - 1) // ALIGN * ALIGN for ptr, p in params.items()}
    total = sum(sizes.values())
    if total < HUGE_PAGE:
        return False
    buf = mmap.mmap(-1, total + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    offset = _madvise_huge(buf)
    if offset is None:
        buf.close()
        return False
    raw = torch.frombuffer(buf, dtype=torch.uint8)  # the tensors keep `buf` alive
    with torch.no_grad():
        for ptr, p in params.items():
            n = p.numel() * p.element_size()
            view = raw[offset:offset + n].view(p.dtype).view(p.shape)
            view.copy_(p.data)
            p.data = view
            offset += sizes[ptr]
    return True
