"""Every Triton kernel builds for real GPUs (sm_80, sm_90, sm_86) on a machine without one.

The interpreter tests check the kernels' numbers; these check what only a real build can:
that each configuration the dispatch launches compiles, fits the target's shared memory,
adds 64-bit offsets to its pointers, runs its 16-bit products on tensor cores (and its fp32 products
exactly, on the CUDA cores), and keeps its grid independent of the sequence
length (checked on their own: the chunk-parallel kernels of chapters 1-2, whose intra-chunk and
output grids grow with the number of chunks while the state pass keeps its grid; chapter 6's
kernel-trick forward, a program per block of queries; the Newton-Schulz kernel, one program per
matrix of a chunk; the caching readout). The builds run in a subprocess with ``TRITON_INTERPRET``
unset (``atlaslib.aot``).

Full builds take minutes per kernel on 2 cores (ptxas on 64x256 fp32 tiles: 1.5-2.5 min), far
beyond the CI budget, so ``make test`` builds each configuration only until its shared memory is
allocated (``atlaslib.aot --fast``, about a second a build, the targets in parallel): every
check below but registers and spills, which need ptxas. ``ATLAS_AOT=1`` (``make aot``) runs the
full builds and checks those too.
"""
import json
import os
import warnings
from pathlib import Path

import pytest
import torch

import atlaslib
from atlaslib import aot
from atlaslib.core.dispatch import forward_or_fallback, with_chunk_backward

FAMILIES = {"linear", "linear_bwd", "delta", "delta_bwd", "titans", "omega", "swla", "atlas", "deep", "caching"}
# Families whose grid is one program per matrix rather than one per head: chapter 5's
# Newton-Schulz kernel, launched once per chunk on that chunk's B*H*b momenta.
ONE_PROGRAM_PER_MATRIX = {"atlas"}
# Families with one program per block of tokens: chapter 7's readout of cached states, where no
# state runs from one token to the next.
ONE_PROGRAM_PER_TOKEN_BLOCK = {"caching"}
# Families run as the chunk-parallel forward (core.chunk_kernels): a state pass over chunks, and
# intra-chunk and output kernels with a program per chunk.
CHUNK_PARALLEL = {"linear", "delta"}
# The chunk-parallel backward of chapters 1 and 2 (and the reverse state pass of core.chunk_backward):
# the same split, with the reverse pass as the serial part.
CHUNK_PARALLEL_BACKWARD = {"linear_bwd"}
DELTA_BACKWARD = {"delta_bwd"}
# Kernels with a program per block of queries, as FlashAttention's forward: chapter 6's kernel-trick
# DeepTransformer, whose query blocks share nothing.
QUERY_BLOCK_KERNELS = {"deep_kernel_fwd_kernel"}
# DOT's recursive solve: the serial leaf kernel (a program per head and value block, launched once per
# leaf) and the recall kernel between halves (a program per block of tokens).
DOT_SOLVE_KERNELS = {"dot_solve_kernel", "dot_recall_kernel"}


# Kernels that walk the chunks of a head in one program (the state passes of chapters 1-2, Titans, the
# Omega rule and SWLA): launched with their share of the registers (``core.kernels.register_share``).
SERIAL_KERNELS = {"chunk_state_kernel", "chunk_dstate_kernel", "titans_linear_fwd_kernel", "omega_fwd_kernel"}


def family(build):
    return build["config"].split(":")[0]


def run_aot(*args, status=0):
    proc = aot.in_subprocess([*args, "--json"])
    assert proc.returncode == status, proc.stderr[-4000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


FULL = os.environ.get("ATLAS_AOT") == "1"
slow_builds = pytest.mark.skipif(not FULL, reason="registers and spills need ptxas, minutes per kernel: run `make aot`")


@pytest.fixture(scope="module")
def builds():
    # one subprocess per target, side by side on the two cores
    procs = [aot.popen_subprocess(["--json", "--target", t] + ([] if FULL else ["--fast"])) for t in aot.TARGETS]
    out = [(p.communicate(), p.returncode) for p in procs]
    # status 1 with builds printed: some build failed a check, which the tests below name
    assert all(code == 0 or (code == 1 and '{"kernel"' in stdout) for (stdout, _), code in out), \
        "\n".join(err[-4000:] for (_, err), _ in out)
    return [json.loads(line) for (stdout, _), _ in out for line in stdout.splitlines() if line.startswith("{")]


def test_every_kernel_family_and_target_is_built(builds):
    assert {family(b) for b in builds} == FAMILIES
    per_config = {}
    for b in builds:
        per_config.setdefault(b["config"], set()).add(b["target"])
    assert all(targets == set(aot.TARGETS) for targets in per_config.values())
    # every @triton.jit kernel of every module that defines one (found as tests/test_gpu.py finds them, so a
    # new kernel module is covered without a list here) is among the built ones
    import importlib
    import re

    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    root = Path(atlaslib.__file__).parent
    modules = [importlib.import_module(".".join(("atlaslib", *p.relative_to(root).with_suffix("").parts)))
               for p in sorted(root.rglob("*.py")) if re.search(r"^\s*@triton\.jit", p.read_text(), flags=re.M)]
    assert len(modules) >= 10
    launched = {name for mod in modules for name, obj in vars(mod).items()
                if isinstance(obj, (JITFunction, InterpretedFunction)) and name.endswith("_kernel")}
    assert {"newton_schulz_kernel", "cached_readout_fwd_kernel"} <= launched
    assert launched <= {b["kernel"] for b in builds}, sorted(launched - {b["kernel"] for b in builds})


def test_every_configuration_compiles(builds):
    failed = [f"{b['config']} on {b['target']}: {b['error']}" for b in builds if b["error"]]
    assert not failed, "\n".join(failed)


def test_shared_memory_within_each_target(builds):
    over = [f"{b['config']} on {b['target']}: {b['shared']} B > {aot.TARGETS[b['target']]['shared_limit']} B"
            for b in builds if not b["fits"] and not b["runs_chunk_form"]]
    assert not over, "\n".join(over)
    assert all(b["shared"] > 0 for b in builds)


def test_on_a_consumer_card_only_the_known_fp32_configurations_run_the_chunk_form(builds):
    # the A100 and H100 take every configuration; a 99 KB card (sm_86, narrow tiles) all 16-bit ones and
    # all fp32 ones but those ``aot.CHUNK_FORM_ON`` names, no more and no fewer
    assert set(aot.CHUNK_FORM_ON) == {"sm_86"}
    too_big = {(b["kernel"], b["config"]) for b in builds if b["target"] == "sm_86" and not b["fits"]}
    assert too_big == aot.CHUNK_FORM_ON["sm_86"], (sorted(too_big - aot.CHUNK_FORM_ON["sm_86"]),
                                                   sorted(aot.CHUNK_FORM_ON["sm_86"] - too_big))
    assert all(config.endswith("fp32") for _, config in too_big)
    assert all(b["fits"] for b in builds if b["target"] != "sm_86")
    assert all(b["runs_chunk_form"] == (b["target"] == "sm_86" and (b["kernel"], b["config"]) in too_big)
               for b in builds)
    # the narrow tiles are what fits the rest: the per-channel fp32 output kernel takes 144 KB at full width
    wide = {b["target"]: b["shared"] for b in builds
            if b["kernel"] == "chunk_output_kernel" and b["config"] == "linear: gate=channel K=V=64 fp32"}
    assert wide["sm_86"] <= 99 * 1024 < wide["sm_80"], wide


@slow_builds
def test_registers_are_measured(builds):
    assert all(b["registers"] > 0 and b["spill_stores"] >= 0 for b in builds)


def test_serial_kernels_take_their_share_of_the_registers(builds):
    # an SM has 64K 32-bit registers: a cap above the share of one program's threads could not launch
    serial = [b for b in builds if b["kernel"] in SERIAL_KERNELS]
    assert {b["kernel"] for b in serial} == SERIAL_KERNELS
    wrong = [f"{b['config']}: maxnreg {b['maxnreg']} at {b['warps']} warps" for b in serial
             if not (0 < b["maxnreg"] <= 255 and b["maxnreg"] * 32 * b["warps"] <= 65536)]
    assert not wrong, "\n".join(wrong)
    if FULL:
        assert all(b["registers"] <= b["maxnreg"] for b in serial)


def test_offsets_to_pointer_arguments_are_64_bit(builds):
    # B*H*T*max(K, V) passes 2^31 well within reach: T = 1M tokens, B*H = 256 heads, K = 64
    assert 256 * 2**20 * 64 > aot.INT32_MAX
    narrow = [f"{b['config']} on {b['target']}" for b in builds if not b["int64_bases"]]
    assert not narrow, "32-bit offsets added to a pointer argument:\n" + "\n".join(narrow)



def test_16_bit_inputs_multiply_on_tensor_cores_and_fp32_inputs_exactly(builds):
    """Every product of every kernel, forward and backward, gets a tensor-core layout when the inputs are
    bf16/fp16 (fp32 intermediates rounded to 16 bits next in TF32: the delta rule's inverse, Titans' decay
    product, the Omega rule's gate matrix, Newton-Schulz for bf16; DOT's read of its fp32 coefficients in
    three TF32 products, "tf32x3"), and none does for fp32 inputs, whose
    products stay exact ("ieee", FMAs on the CUDA cores) unless ATLASLIB_TF32=1. One exception: DOT's
    coefficient solve keeps its fp32 products on the CUDA cores (its k.k products are 16-bit)."""
    half = [b for b in builds if "bf16" in b["config"] or "fp16" in b["config"]]
    fp32 = [b for b in builds if "fp32" in b["config"]]
    assert {family(b) for b in half} == {family(b) for b in fp32} == FAMILIES
    on_cuda_cores = [f"{b['config']} on {b['target']}: {b['kernel']} {b['cuda_core_dots']} products"
                     for b in half if not b["tensor_core_dots"]
                     or (b["cuda_core_dots"] and b["kernel"] not in DOT_SOLVE_KERNELS)]
    assert not on_cuda_cores, "16-bit products left on the CUDA cores:\n" + "\n".join(on_cuda_cores)
    on_tensor_cores = [f"{b['config']} on {b['target']}: {b['kernel']}" for b in fp32 if b["tensor_core_dots"]]
    assert not on_tensor_cores, "fp32 products rounded on tensor cores:\n" + "\n".join(on_tensor_cores)
    assert all(b["cuda_core_dots"] > 0 for b in fp32)


# Families whose forward the dispatch runs on q, k, v of any of fp32, bf16 and fp16, and the families of
# chapters 1-2's backward (built per tile width in its widest element, and in bf16)
FORWARD = {"linear", "delta", "titans", "omega", "swla"}
BACKWARD = {"linear_bwd", "delta_bwd"}


def _largest_heads():
    """The largest head (key) size each family's kernels take, from the kernel modules' own limits."""
    from atlaslib.caching.kernel import MAX_KEY as caching
    from atlaslib.core.chunk_backward import MAX_DELTA_KEY
    from atlaslib.delta.kernel import MAX_KEY as delta
    from atlaslib.linear.kernel import MAX_KEY as linear
    from atlaslib.miras.kernel import MAX_KEY as titans
    from atlaslib.omega.kernel import MAX_FEATURES
    return {"linear": linear, "delta": delta, "titans": titans, "omega": MAX_FEATURES, "swla": MAX_FEATURES,
            "caching": caching, "linear_bwd": linear, "delta_bwd": MAX_DELTA_KEY}


def _head_and_dtype(build):
    import re
    head, dtype = re.search(r"\b[KD]=V=(\d+)\b", build["config"]), re.search(r"\b(fp32|bf16|fp16)\b", build["config"])
    return int(head.group(1)) if head else None, dtype.group(1) if dtype else None


def test_the_largest_head_each_kernel_takes_is_built(builds):
    for fam, largest in _largest_heads().items():
        for target in aot.TARGETS:
            assert any(family(b) == fam and b["target"] == target and _head_and_dtype(b)[0] == largest
                       for b in builds), (fam, largest, target)


def test_every_dtype_the_forward_takes_is_built_at_every_head_size(builds):
    for fam in FORWARD:
        built = {_head_and_dtype(b) for b in builds if family(b) == fam}
        assert {dt for _, dt in built} == {"fp32", "bf16", "fp16"}, (fam, built)
        # each power-of-two head built in fp32 is built in bf16 too (a padded odd size only in fp32)
        powers = {k for k, dt in built if dt == "fp32" and k & (k - 1) == 0}
        assert powers and all((k, "bf16") in built for k in powers), (fam, sorted(built, key=str))


def test_the_backward_builds_its_widest_element_at_its_largest_head(builds):
    import re
    widest = max((torch.float32, torch.bfloat16, torch.float16), key=lambda dt: dt.itemsize)
    name = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[widest]
    largest = _largest_heads()
    for fam in BACKWARD:
        for gate in ("none", "scalar", "channel"):
            config = f"{fam}: gate={gate} K=V={largest[fam]} {name}"
            assert any(re.fullmatch(re.escape(config), b["config"]) for b in builds), config


def test_newton_schulz_is_built_for_bf16_momenta(builds):
    # the chunk form hands the kernel fp32 momenta whatever q, k, v's dtype: only a direct call of
    # newton_schulz_triton reaches its bf16 loads and stores
    direct = [b for b in builds if family(b) in ONE_PROGRAM_PER_MATRIX and "newton_schulz_triton" in b["config"]
              and b["kernel"] == "newton_schulz_kernel" and "bf16" in b["config"]]
    assert {b["target"] for b in direct} == set(aot.TARGETS)
    assert all(b["tensor_core_dots"] > 0 and not b["error"] for b in direct)


def test_dot_units_reads_where_each_product_runs():
    fma = ("%1 = tt.dot %a, %b, %c, inputPrecision = ieee : tensor<16x64xf32, #ttg.dot_op<{opIdx = 0, "
           "parent = #blocked}>> * tensor<64x64xf32, #ttg.dot_op<{opIdx = 1, parent = #blocked}>> "
           "-> tensor<16x64xf32, #blocked>")
    mma = fma.replace("inputPrecision = ieee", "inputPrecision = tf32").replace("#blocked", "#mma1")
    wgmma = ("%3 = ttng.warp_group_dot %a, %b, %c {inputPrecision = 0 : i32} : !ttg.memdesc<64x64xbf16, "
             "#shared, #smem> * !ttg.memdesc<64x128xbf16, #shared1, #smem> -> tensor<64x128xf32, #mma>")
    assert aot.dot_units(fma) == (0, 1)
    assert aot.dot_units(mma) == (1, 0)
    assert aot.dot_units("\n".join([fma, mma, wgmma, "%4 = arith.addf %x, %y : tensor<16xf32, #blocked>"])) == (2, 1)

def test_grid_does_not_grow_with_the_sequence(builds):
    # programs loop over chunks, so T = 1M launches the grid of T = 40: B*H on axis 0
    # (limit 2^31 - 1) and value tiles on axis 1 (limit 65535); the chunk-parallel kernels of
    # chapters 1-2, the Newton-Schulz kernel and the caching readout are checked on their own below
    per_head = [b for b in builds if family(b) not in
                ONE_PROGRAM_PER_MATRIX | ONE_PROGRAM_PER_TOKEN_BLOCK | CHUNK_PARALLEL | CHUNK_PARALLEL_BACKWARD
                | DELTA_BACKWARD and b["kernel"] not in QUERY_BLOCK_KERNELS | DOT_SOLVE_KERNELS]
    assert per_head and all(b["grid_fixed_in_T"] for b in per_head)
    assert all(b["grid"][0] == 2 and len(b["grid"]) == 2 and b["grid"][1] <= 65535 for b in per_head)
    assert all(b["launches"] == [1, 1] for b in per_head)


def test_chunk_parallel_grids_grow_with_the_chunks_and_the_state_pass_does_not(builds):
    # Chapters 1-2: the intra-chunk kernels (WY factors, per-channel scores) and the output kernel
    # have B*H*cdiv(T, BT) programs on axis 0 (limit 2^31 - 1), so their grid grows with T; the
    # state pass, the one serial part, keeps the grid (B*H, value blocks, key blocks) at every T
    from atlaslib.core.chunk_kernels import CHUNK
    chunked = [b for b in builds if family(b) in CHUNK_PARALLEL]
    kernels = {b["kernel"] for b in chunked}
    assert kernels == {"chunk_state_kernel", "chunk_output_kernel", "channel_scores_kernel", "delta_wy_kernel"}
    for b in chunked:
        assert b["launches"] == [1, 1], b["config"]
        if b["kernel"] == "chunk_state_kernel":
            assert b["grid_fixed_in_T"] and b["grid"][0] == 2 and len(b["grid"]) == 3, b["config"]
            assert max(b["grid"][1:]) <= 65535
        else:
            assert not b["grid_fixed_in_T"], b["config"]
            assert b["grid"][0] == 2 * -(-40 // CHUNK) and b["grid_long"][0] == 2 * -(-400 // CHUNK), b["config"]
            assert all(n <= 65535 for n in b["grid"][1:])


def test_backward_grids_grow_with_the_chunks_and_the_reverse_pass_does_not(builds):
    # Chapter 1's gradient kernels have B*H*cdiv(T, BT) programs on axis 0, like the forward's output
    # kernel; the reverse state pass keeps (B*H, value blocks, key blocks) at every T
    from atlaslib.core.chunk_kernels import CHUNK
    backward = [b for b in builds if family(b) in CHUNK_PARALLEL_BACKWARD]
    assert {b["kernel"] for b in backward} == {"chunk_dstate_kernel", "linear_dv_kernel", "linear_dqk_kernel",
                                               "channel_dqk_kernel", "channel_scores_kernel"}
    for b in backward:
        assert b["launches"] == [1, 1], b["config"]
        if b["kernel"] == "chunk_dstate_kernel":
            assert b["grid_fixed_in_T"] and b["grid"][0] == 2 and len(b["grid"]) == 3, b["config"]
        else:
            assert not b["grid_fixed_in_T"], b["config"]
            assert b["grid"][0] == 2 * -(-40 // CHUNK) and b["grid_long"][0] == 2 * -(-400 // CHUNK), b["config"]
        assert all(n <= 65535 for n in b["grid"][1:])


def test_delta_backward_grids_grow_with_the_chunks_and_the_state_passes_do_not(builds):
    # Chapter 2's backward reruns the forward's WY factors and state pass (and KDA's scores), then the
    # intra-chunk dv, the reverse state pass and the two per-chunk gradient kernels (KDA: three, with the
    # per-channel dS terms of chapter 1's sub-chunk kernel): each launched once;
    # the per-chunk kernels have B*H*cdiv(T, BT) programs on axis 0, the two state passes keep
    # (B*H, value blocks, key blocks) at every T
    from atlaslib.core.chunk_kernels import CHUNK
    backward = [b for b in builds if family(b) in DELTA_BACKWARD]
    assert {b["kernel"] for b in backward} == {"delta_wy_kernel", "chunk_state_kernel", "channel_scores_kernel",
                                               "delta_dv_local_kernel", "chunk_dstate_kernel",
                                               "delta_bwd_state_kernel", "channel_dqk_kernel", "delta_bwd_wy_kernel"}
    for b in backward:
        assert b["launches"] == [1, 1], b["config"]
        if b["kernel"] in ("chunk_state_kernel", "chunk_dstate_kernel"):
            assert b["grid_fixed_in_T"] and b["grid"][0] == 2 and len(b["grid"]) == 3, b["config"]
        else:
            assert not b["grid_fixed_in_T"], b["config"]
            assert b["grid"][0] == 2 * -(-40 // CHUNK) and b["grid_long"][0] == 2 * -(-400 // CHUNK), b["config"]
        assert all(n <= 65535 for n in b["grid"][1:])


def test_query_block_grids_grow_with_the_sequence(builds):
    # Chapter 6's kernel-trick forward: (B*H * query blocks of BM = 32 or 64 rows on axis 0, limit
    # 2^31 - 1; value blocks on axis 1), so T = 400 launches B*H*cdiv(400, BM) where T = 40 launched
    # B*H*cdiv(40, BM)
    blocks = [b for b in builds if b["kernel"] in QUERY_BLOCK_KERNELS]
    assert blocks
    for b in blocks:
        assert b["launches"] == [1, 1] and len(b["grid"]) == 2 and b["grid"][1] == b["grid_long"][1], b["config"]
        assert b["grid"][1] <= 65535, b["config"]
        assert (b["grid"][0], b["grid_long"][0]) in {(2 * -(-40 // bm), 2 * -(-400 // bm)) for bm in (32, 64)}, \
            b["config"]


def test_dot_leaves_keep_their_grid_and_the_recall_grid_grows(builds):
    # DOT's solve (chapter 6): the leaf kernel keeps the grid (B*H, value blocks) and is launched once per
    # leaf, more often at T = 400; between two halves the recall kernel has a program per block of the
    # later half's tokens (B*H * blocks on axis 0), one launch fewer than the leaves
    leaves = {(b["config"], b["target"]): b for b in builds if b["kernel"] == "dot_solve_kernel"}
    recalls = [b for b in builds if b["kernel"] == "dot_recall_kernel"]
    assert leaves and recalls
    for b in leaves.values():
        assert b["grid_fixed_in_T"] and b["grid"][0] == 2 and len(b["grid"]) == 2, b["config"]
        assert 1 <= b["launches"][0] < b["launches"][1], b["config"]
    for b in recalls:
        leaf = leaves[(b["config"], b["target"])]
        assert [n + 1 for n in b["launches"]] == list(leaf["launches"]), b["config"]
        assert b["grid"][0] % 2 == 0 and b["grid_long"][0] > b["grid"][0] and b["grid"][1] == leaf["grid"][1]
        assert b["grid"][1] <= 65535


def test_newton_schulz_grid_is_one_program_per_matrix_of_a_chunk(builds):
    # Exemption: one program per momentum matrix [V, K]. The chunk form orthogonalises one
    # chunk's momenta per launch, B*H*b of them (b = 16, B*H = 2), so the grid is bounded by
    # B*H*b on axis 0 (limit 2^31 - 1) whatever T, and the number of launches, ceil(T / b),
    # is what grows with T.
    from atlaslib.atlas import ATLAS_CHUNK_SIZE as b
    per_matrix = [x for x in builds if family(x) in ONE_PROGRAM_PER_MATRIX]
    assert per_matrix
    assert all(x["grid"] == [2 * b] and x["grid_fixed_in_T"] for x in per_matrix)
    assert 2 * b <= aot.INT32_MAX
    through_the_chunk_form = [x for x in per_matrix if "newton_schulz_triton" not in x["config"]]
    assert through_the_chunk_form
    assert all(x["launches"] == [-(-40 // b), -(-400 // b)] for x in through_the_chunk_form)


def test_caching_grid_is_one_program_per_block_of_tokens(builds):
    # Exemption: the readout carries no state between tokens, so its grid is (B*H * cdiv(T, BT),
    # cdiv(V, BV)): axis 0 grows with T (limit 2^31 - 1, T up to 2^31 * BT / (B*H) tokens), axis 1
    # holds the value tiles as elsewhere; one launch per call
    from atlaslib.caching.kernel import TOKENS_PER_PROGRAM as bt
    per_block = [b for b in builds if family(b) in ONE_PROGRAM_PER_TOKEN_BLOCK]
    assert per_block
    assert all(b["grid"][0] == 2 * -(-40 // bt) and len(b["grid"]) == 2 and b["grid"][1] <= 65535
               for b in per_block)
    assert all(not b["grid_fixed_in_T"] and b["launches"] == [1, 1] for b in per_block)


def test_oversized_takes_no_family(capsys):
    with pytest.raises(SystemExit) as exit_:
        aot.main(["--oversized", "--family", "caching"])
    assert exit_.value.code == 2 and "it takes no --family" in capsys.readouterr().err


def test_an_oversized_tile_is_caught():
    (over,) = run_aot("--oversized", "--target", "sm_80", *([] if FULL else ["--fast"]), status=1)
    assert not over["fits"], over


def test_int64_check_can_fail():
    ttir = ("%q = tt.splat %q_ptr : !tt.ptr<f32> -> tensor<16x!tt.ptr<f32>>\n"
            "%a = tt.addptr %q, %offs : tensor<16x!tt.ptr<f32>>, tensor<16xi32>\n")
    assert not aot.int64_bases(ttir, ["q_ptr"])
    assert aot.int64_bases(ttir.replace("xi32", "xi64"), ["q_ptr"])
    # Triton names most splats with numbers
    numbered = ("%43 = tt.splat %q_ptr : !tt.ptr<f32> -> tensor<16x!tt.ptr<f32>>\n"
                "%44 = tt.addptr %43, %offs : tensor<16x!tt.ptr<f32>>, tensor<16xi32>\n")
    assert not aot.int64_bases(numbered, ["q_ptr"])
    assert aot.int64_bases(numbered.replace("xi32", "xi64"), ["q_ptr"])
    # an addition to a scalar pointer argument, and to a pointer that is not an argument's
    scalar = "%5 = tt.addptr %k_ptr, %off : !tt.ptr<f32>, i32\n"
    assert not aot.int64_bases(scalar, ["k_ptr"]) and aot.int64_bases(scalar.replace("i32", "i64"), ["k_ptr"])
    assert aot.int64_bases(numbered, ["k_ptr"])
    # one 64-bit and one 32-bit addition: every one must be 64-bit
    mixed = ("%7 = tt.addptr %k_ptr, %off : !tt.ptr<f32>, i64\n"
             "%8 = tt.splat %v_ptr : !tt.ptr<f32> -> tensor<16x!tt.ptr<f32>>\n"
             "%9 = tt.addptr %8, %offs : tensor<16x!tt.ptr<f32>>, tensor<16xi32>\n")
    assert not aot.int64_bases(mixed, ["k_ptr", "v_ptr"])
    assert aot.int64_bases(mixed.replace("xi32", "xi64"), ["k_ptr", "v_ptr"])


# The cards' documented limits (CUDA C Programming Guide, "Technical Specifications per Compute Capability"):
# the most shared memory one block may opt in to, 163 KB on compute capability 8.0 (A100) and 227 KB on 9.0
# (H100), in KiB.
DOCUMENTED = {"sm_80": {"cc": 80, "shared_limit": 163 * 1024}, "sm_90": {"cc": 90, "shared_limit": 227 * 1024},
              "sm_86": {"cc": 86, "shared_limit": 99 * 1024}}


def test_each_target_has_its_cards_documented_limit_and_architecture():
    assert {t: {k: v[k] for k in ("cc", "shared_limit")} for t, v in aot.TARGETS.items()} == DOCUMENTED
    assert DOCUMENTED["sm_80"]["shared_limit"] == 166912 and DOCUMENTED["sm_90"]["shared_limit"] == 232448
    assert DOCUMENTED["sm_86"]["shared_limit"] == 101376
    # the tiles are sized for the A100's limit; anything below it takes the narrow ones
    from atlaslib.core.kernels import FULL_SHARED_MEMORY
    assert FULL_SHARED_MEMORY == DOCUMENTED["sm_80"]["shared_limit"]
    for name in aot.TARGETS:                        # sm_XY builds for compute capability X.Y
        assert aot.TARGETS[name]["cc"] == int(name.removeprefix("sm_")) == aot._target(name).arch, name


@pytest.fixture(scope="module")
def probes(tmp_path_factory):
    """Real builds (fast, every target, a fresh cache) of the kernels in tests/aot_probe_kernels.py."""
    from aot_builds import real_builds
    out = real_builds("aot_probe_kernels.py", tmp_path_factory.mktemp("aot_cache"))
    return {(b["config"].removeprefix("probe: "), b["target"]): b for b in out}


def test_a_32_bit_base_offset_is_caught_by_a_real_build(probes):
    for target in aot.TARGETS:
        narrow, wide = probes["narrow", target], probes["wide", target]
        assert not narrow["error"] and not wide["error"], (narrow["error"], wide["error"])
        assert not narrow["int64_bases"], narrow
        assert wide["int64_bases"], wide


def test_a_tile_between_the_two_cards_limits_fits_only_the_h100(probes):
    a100, h100 = (DOCUMENTED[t]["shared_limit"] for t in ("sm_80", "sm_90"))
    between = probes["between", "sm_90"]
    assert not between["error"] and a100 < between["shared"] <= h100, between
    assert between["fits"] and not probes["between", "sm_80"]["fits"]
    over = probes["over", "sm_90"]
    assert not over["error"] and over["shared"] > h100 and not over["fits"], over
    table = [aot.Build(**{k: v for k, v in probes["between", t].items() if k != "fits"}) for t in aot.TARGETS]
    rows = {r["target"]: r for r in _columns(aot.format_builds(table))}
    assert (rows["sm_80"]["ok"], rows["sm_90"]["ok"]) == ("TOO BIG", "yes"), rows


def test_a_fast_build_leaves_registers_and_spills_unmeasured(probes):
    # a fast build stops before ptxas, which is what reports registers and spills
    assert all((b["registers"], b["spill_stores"], b["spill_loads"]) == (-1, -1, -1) for b in probes.values())


@pytest.mark.skipif(FULL, reason="full builds measure registers and spills")
def test_fast_builds_leave_registers_and_spills_unmeasured(builds):
    assert all((b["registers"], b["spill_stores"], b["spill_loads"]) == (-1, -1, -1) for b in builds)


def test_a_changed_offset_check_is_not_answered_from_the_cache(monkeypatch, tmp_path):
    # a cached verdict of the 64-bit check holds only for the check that gave it
    import dataclasses
    import re
    from types import SimpleNamespace
    monkeypatch.setattr(aot, "CACHE_DIR", tmp_path)
    monkeypatch.setattr(aot, "specialised", lambda launch, target: (None, None, "key"))
    launch = SimpleNamespace(kernel=SimpleNamespace(fn=SimpleNamespace(__name__="k"), params=[]), args=())
    cached = aot.Build("k", "linear: cached", "sm_80", 1024, -1, -1, -1, True)
    (tmp_path / f"k-key-{aot.checks_version()}-fast.json").write_text(json.dumps(dataclasses.asdict(cached)))
    hit = aot.build(launch, "sm_80", "linear: cached", full=False)
    assert (hit.shared, hit.error, hit.int64_bases) == (1024, "", True)
    monkeypatch.setattr(aot, "ADDPTR", re.compile(r"tt\.addptr (%[A-Za-z_][\w]*), %[\w]+ : [^,]+, (i32|i64)"))
    rebuilt = aot.build(launch, "sm_80", "linear: cached", full=False)     # not from the cache: built (and
    assert rebuilt.shared == 0 and rebuilt.error                            # failing, this launch is a stub)


def _builds_to_judge():
    """A build over sm_80's limit, one that failed, one with 32-bit offsets and one exactly at the limit."""
    limit = aot.TARGETS["sm_80"]["shared_limit"]
    over = aot.Build("k", "linear: over", "sm_80", limit + 1024, 0, 0, 0, True)
    failed = aot.Build("k", "linear: failed", "sm_80", 0, 0, 0, 0, False, error="CompilationError: bad")
    narrow = aot.Build("k", "linear: narrow", "sm_80", 1024, 0, 0, 0, False)
    good = aot.Build("k", "linear: good", "sm_80", limit, 0, 0, 0, True)
    return over, failed, narrow, good


def _columns(text):
    """A ``format_table`` table as one dict per row, cut at the columns of its dashes line."""
    lines = text.splitlines()
    spans, start = [], 0
    for dashes in lines[1].split("  "):
        spans.append((start, start + len(dashes)))
        start += len(dashes) + 2
    header = [lines[0][a:b].strip() for a, b in spans]
    return [dict(zip(header, (line[a:b].strip() for a, b in spans))) for line in lines[2:]]


def test_a_failed_build_does_not_fit_and_the_table_says_why():
    over, failed, narrow, good = _builds_to_judge()
    assert (over.fits, failed.fits, narrow.fits, good.fits) == (False, False, True, True)
    rows = {r["config"]: r for r in _columns(aot.format_builds([over, failed, narrow, good]))}
    assert [rows[c]["ok"] for c in ("over", "failed", "narrow", "good")] == ["TOO BIG", "BUILD FAILED", "yes", "yes"]
    assert [rows[c]["int64"] for c in ("over", "failed", "narrow", "good")] == ["yes", "NO", "NO", "yes"]
    assert all(r["limit KB"] == "163" and r["target"] == "sm_80" for r in rows.values())
    fast = aot.Build("k", "linear: fast", "sm_80", 1024, -1, -1, -1, True)          # --fast: unmeasured
    (row,) = _columns(aot.format_builds([fast]))
    assert (row["regs"], row["spill B"]) == ("-", "-"), row


def test_the_table_gives_each_target_its_own_limit_in_one_unit():
    # 192 KiB: over an A100's 163 KB, within an H100's 227 KB (DOCUMENTED); KB columns in KiB, as the guide's
    size = 192 * 1024
    builds = [aot.Build("k", f"linear: {t}", t, size, 0, 0, 0, True, tensor_core_dots=3, cuda_core_dots=1)
              for t in ("sm_80", "sm_90")]
    builds += [aot.Build("k", f"linear: at the {t} limit", t, DOCUMENTED[t]["shared_limit"], 0, 0, 0, True)
               for t in ("sm_80", "sm_90")]
    rows = {r["config"]: r for r in _columns(aot.format_builds(builds))}
    assert [(rows[t]["limit KB"], rows[t]["ok"]) for t in ("sm_80", "sm_90")] == [("163", "TOO BIG"), ("227", "yes")]
    assert all(float(rows[t]["shared KB"]) == 192 for t in ("sm_80", "sm_90")), rows
    for t in ("sm_80", "sm_90"):
        row = rows[f"at the {t} limit"]
        assert float(row["shared KB"]) == float(row["limit KB"]) == DOCUMENTED[t]["shared_limit"] / 1024, row
        assert row["ok"] == "yes", row
    assert rows["sm_90"]["dots TC/CUDA"] == "3/1"        # tensor-core products, then CUDA-core ones


@pytest.mark.parametrize("as_json", [False, True])
def test_the_command_fails_when_a_build_fails_a_check(monkeypatch, capsys, as_json):
    import atlaslib.core.dispatch
    over, failed, narrow, good = _builds_to_judge()
    monkeypatch.setattr(atlaslib.core.dispatch, "interpreter_on", lambda: False)
    json_flag = ["--json"] if as_json else []
    monkeypatch.setattr(aot, "check_all", lambda *a, **k: [over, failed, narrow, good])
    assert aot.main(["--fast", *json_flag]) == 1
    out = capsys.readouterr().out
    if as_json:
        assert [json.loads(line)["fits"] for line in out.splitlines()] == [False, False, True, True]
    else:
        assert out.rstrip().endswith("\n4 builds, 3 that would not launch or address 64-bit offsets"), out
    monkeypatch.setattr(aot, "check_all", lambda *a, **k: [good, good])
    assert aot.main(["--fast", *json_flag]) == 0
    if not as_json:
        assert capsys.readouterr().out.rstrip().endswith("\n2 builds, 0 that would not launch or address "
                                                         "64-bit offsets")


def test_only_a_known_configuration_too_big_for_a_consumer_card_passes_as_the_chunk_form(monkeypatch, capsys):
    import atlaslib.core.dispatch
    kernel, config = sorted(aot.CHUNK_FORM_ON["sm_86"])[0]
    size = 120 * 1024                   # over sm_86's 99 KB, within sm_80's 163 KB
    known = aot.Build(kernel, config, "sm_86", size, 0, 0, 0, True)
    unknown = aot.Build(kernel, "linear: gate=none K=V=64 fp32", "sm_86", size, 0, 0, 0, True)
    elsewhere = aot.Build(kernel, config, "sm_80", 170 * 1024, 0, 0, 0, True)      # the list is per target
    failed = aot.Build(kernel, config, "sm_86", 0, 0, 0, 0, True, error="CompilationError: bad")
    assert [b.runs_chunk_form for b in (known, unknown, elsewhere, failed)] == [True, False, False, False]
    assert not known.fits
    rows = _columns(aot.format_builds([known, unknown, elsewhere, failed]))
    assert [r["ok"] for r in rows] == ["chunk form", "TOO BIG", "TOO BIG", "BUILD FAILED"]
    monkeypatch.setattr(atlaslib.core.dispatch, "interpreter_on", lambda: False)
    monkeypatch.setattr(aot, "check_all", lambda *a, **k: [known, known])
    assert aot.main(["--fast"]) == 0
    assert capsys.readouterr().out.rstrip().endswith("\n2 builds, 0 that would not launch or address 64-bit offsets; "
                                                     "2 known too big for the card, where the chunk form runs instead")
    for bad in (unknown, elsewhere, failed):
        monkeypatch.setattr(aot, "check_all", lambda *a, bad=bad, **k: [known, bad])
        assert aot.main(["--fast", "--json"]) == 1
        assert [json.loads(line)["runs_chunk_form"] for line in capsys.readouterr().out.splitlines()] == \
            [True, False]


def test_a_kernel_the_card_refuses_falls_back_to_the_chunk_form():
    from triton.runtime.errors import OutOfResources

    def too_big(x):
        raise OutOfResources(300_000, 232_448, "shared memory")

    def chunk(x):
        return (2 * x,)

    x = torch.randn(3, requires_grad=True)
    with pytest.warns(RuntimeWarning, match="does not fit this GPU"):
        (y,) = forward_or_fallback(too_big, chunk, x.detach())
    torch.testing.assert_close(y, 2 * x.detach())
    with pytest.warns(RuntimeWarning, match="chunk form"):
        (y,) = with_chunk_backward(too_big, chunk, x)
    y.sum().backward()
    torch.testing.assert_close(x.grad, torch.full((3,), 2.0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ValueError):       # other errors are not swallowed
            forward_or_fallback(lambda x: (_ for _ in ()).throw(ValueError("bad")), chunk, x)


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a CUDA machine `make gpu-test` runs the GPU tests")
def test_gpu_test_target_degrades_cleanly_without_cuda():
    import subprocess
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run(["make", "-s", "gpu-test"], capture_output=True, text=True, cwd=root, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "no CUDA device" in out.stdout


def test_a_loop_over_chunks_is_built_where_it_runs_more_than_once():
    # Triton compiles an integer argument equal to 1 as a constant, which drops a loop over one chunk
    # with its pipeline: a kernel that loops up to such an argument is built from the longer call
    # (chapter 1's state pass loops over the NT chunks), any other from the short one (the output
    # kernel has NT = 1 too, but only divides by it)
    from atlaslib.core.chunk_kernels import chunk_output_kernel, chunk_state_kernel
    from atlaslib.linear.kernel import linear_attention_triton

    def launches(T):
        q = torch.randn(1, 2, T, 16)
        return aot.by_kernel(aot.captured_launches(lambda: linear_attention_triton(q, q, q, None, None)))
    short, longer = launches(40), launches(400)
    state, output = chunk_state_kernel.fn.__name__, chunk_output_kernel.fn.__name__
    assert aot.representative(short[state][0], longer[state][0]) is longer[state][0]
    assert aot.representative(short[output][0], longer[output][0]) is short[output][0]


def test_families_are_those_the_cases_yield():
    assert set(aot.FAMILIES) == {family for family, _, _ in aot.cases()} == FAMILIES


def test_an_unknown_family_is_refused_naming_the_known_ones(capsys):
    with pytest.raises(SystemExit) as exit_:
        aot.main(["--family", "nosuch", "--fast"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "invalid choice: 'nosuch'" in err and "'caching'" in err, err


def test_help_names_the_module(capsys):
    with pytest.raises(SystemExit) as exit_:
        aot.main(["--help"])
    assert exit_.value.code == 0 and capsys.readouterr().out.startswith("usage: python -m atlaslib.aot ")
