"""Kernels built by tests/test_aot.py to show that the build checks can fail: run as a script (with
``TRITON_INTERPRET`` unset), it builds them for every target and prints one JSON object per build.

``narrow_base_kernel`` computes a head's base offset, program * T * K, in 32 bits (past 2^31 at long T);
``wide_base_kernel`` is the same in 64 bits. The output kernel of chapter 1 forced to two tile sets:
fp32 at K = 128 with BT = 64, BK = 128, BV = 64 (192 KiB: over an A100's 163 KB, within an H100's 227 KB),
and bf16 at K = 128 with BT = BK = 128, BV = 64 (240 KiB: over both).
"""
import dataclasses
import json

import torch
import triton
import triton.language as tl


@triton.jit
def narrow_base_kernel(x_ptr, y_ptr, T, K: tl.constexpr):
    offs = tl.program_id(0) * T * K + tl.arange(0, K)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs))


@triton.jit
def wide_base_kernel(x_ptr, y_ptr, T, K: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * T * K + tl.arange(0, K)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs))


def forced_output_tiles(dtype, K, **tiles):
    from atlaslib import aot
    from atlaslib.linear.kernel import linear_attention_triton

    q, k, v = aot._qkv(K, K, dtype, 40)
    launches = aot.by_kernel(aot.captured_launches(lambda: linear_attention_triton(q, k, v, None,
                                                                                   torch.zeros(1, 2, K, K))))
    (launch,) = launches["chunk_output_kernel"]
    launch.kwargs.update(tiles)
    return launch


def main():
    from atlaslib import aot

    x = torch.zeros(2 * 40 * 64)
    launches = {"narrow": aot.Launch(narrow_base_kernel, (2,), (x, x, 40), {"K": 64}),
                "wide": aot.Launch(wide_base_kernel, (2,), (x, x, 40), {"K": 64}),
                "between": forced_output_tiles(torch.float32, 128, BT=64, BK=128, BV=64),
                "over": forced_output_tiles(torch.bfloat16, 128, BT=128, BK=128, BV=64)}
    for target in aot.TARGETS:
        for name, launch in launches.items():
            result = aot.build(launch, target, f"probe: {name}", full=False)
            print(json.dumps(dict(dataclasses.asdict(result), fits=result.fits)), flush=True)


if __name__ == "__main__":
    main()
