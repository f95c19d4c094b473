"""A prompt's products on packed blocks (``ml/cpu/blocks.h``, "Many rows"): from 12 rows on, tiles
of weight rows decoded once and taken a range of blocks and a block of input rows at a time. Each
row's result must be the bits the row gives alone (the decode step's path) at every row count,
for every kind, at sizes that end inside a tile, a range of blocks and a block of rows; and
builds of other instruction sets must agree within the block rounding that test_packed.py allows.
"""

from __future__ import annotations


import pytest
import torch

from builders import OPERATOR_VARIANT_LOAD, skip_where_the_native_build_lacks
from cli_support import run_python
from llama_chat.ml import packed
from llama_chat.ml.cpu import kernels as cpu_kernels
from test_packed import assert_operator_result, in_features_for, needs_kernels, random_weight

MOST_ROWS = 600
# Every count up to past the tiles' start (12) and a pass's rows, then the edges of the blocks of
# 64 input rows the tiles take, and the largest.
ROW_COUNTS = sorted({*range(1, 41), 63, 64, 65, 97, 127, 128, 129, 255, 256, 257, 383, 511, 512, 513, 599, MOST_ROWS})
# Outputs that end inside a tile (of 8 or 16 rows); inputs past one range of blocks (2,048
# values), ending inside the second.
OUT_FEATURES = 21


def blocks_for(kind: str) -> int:
    return 9 if kind.endswith("_k") else 67


def product(x: torch.Tensor, weight: packed.PackedWeight) -> torch.Tensor:
    return torch.ops.llama_chat_cpu.packed_product(x, weight.data, weight.kind)


def case(kind: str, rows: int, seed: int) -> tuple[torch.Tensor, packed.PackedWeight]:
    weight = random_weight(kind, OUT_FEATURES, in_features_for(kind, blocks_for(kind)), seed)
    x = torch.randn(rows, weight.in_features, generator=torch.Generator().manual_seed(seed))
    x[3, 64:96] = 0  # a block of zeros: step 0
    x[70] *= 1e-3  # rows of other sizes beside each other
    return x, weight


@needs_kernels
@pytest.mark.parametrize("kind", packed.PACKED_TYPES)
def test_every_row_count_gives_each_row_the_bits_it_gives_alone(cpu_kernels_loaded, kind):
    assert cpu_kernels_loaded, cpu_kernels.failure()
    x, weight = case(kind, MOST_ROWS, seed=7)
    alone = torch.cat([product(x[r:r + 1], weight) for r in range(MOST_ROWS)])
    assert_operator_result(alone, x, weight)
    for rows in ROW_COUNTS:
        got = product(x[:rows], weight)
        assert torch.equal(got, alone[:rows]), f"{kind}: {rows} rows differ from the rows alone"
    # A range of rows that starts past the first: the tiles' blocks of rows start where it does.
    assert torch.equal(product(x[5:205], weight), alone[5:205])


@needs_kernels
@pytest.mark.parametrize("kind", ["q4_k", "q6_k", "q8_0"])
def test_every_row_count_from_1_to_600_on_a_narrow_weight(cpu_kernels_loaded, kind):
    # Every count, not only the edges above, for the kinds of the prefill benchmark's files (the
    # passes of 4, 2 and 1 rows and the blocks of 64 rows are the same code for every kind). One
    # block (a super-block) of inputs keeps the calls cheap, and the rows alone are taken 11 at a
    # time: below the tiles (12 rows) each row gives the bits it gives alone (the test above).
    assert cpu_kernels_loaded, cpu_kernels.failure()
    weight = random_weight(kind, 9, in_features_for(kind, 1), seed=41)  # a tile and a row of a second
    x = torch.randn(MOST_ROWS, weight.in_features, generator=torch.Generator().manual_seed(41))
    alone = torch.cat([product(x[r:r + 11], weight) for r in range(0, MOST_ROWS, 11)])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a call this small spends most of its time waking a helper thread
    try:
        for rows in range(1, MOST_ROWS + 1):
            assert torch.equal(product(x[:rows], weight), alone[:rows]), f"{kind}: {rows} rows differ from alone"
    finally:
        torch.set_num_threads(threads)


# Tiles are decoded in groups (1 MiB of codes, at most 16 tiles) that take a block of input rows
# at a time (128 KiB of them, at most 64 rows): 256 inputs make groups of 16 tiles and blocks of
# 64 rows, 8,960 inputs groups of 14 tiles (7 of 16 rows with AVX-512 VNNI) and blocks of 12 rows
# (8); rows that fit one block take no group. The outputs end inside the second group's last
# tile; the rows cross several blocks.
GROUP_CASES = [(256, 149, [13, 64, 65, 130]), (8960, 123, [12, 13, 25, 40])]


@needs_kernels
@pytest.mark.parametrize("kind", ["q4_k", "q8_0", "q6_k", "q4_0"])
@pytest.mark.parametrize("in_features, out_features, row_counts", GROUP_CASES, ids=["short-rows", "long-rows"])
def test_groups_of_tiles_and_blocks_of_rows_give_each_row_its_bits_alone(cpu_kernels_loaded, kind, in_features,
                                                                         out_features, row_counts):
    assert cpu_kernels_loaded, cpu_kernels.failure()
    weight = random_weight(kind, out_features, in_features, seed=53)
    most = max(row_counts)
    x = torch.randn(most, in_features, generator=torch.Generator().manual_seed(53))
    alone = torch.cat([product(x[r:r + 1], weight) for r in range(most)])
    assert_operator_result(alone, x, weight)
    for rows in row_counts:
        assert torch.equal(product(x[:rows], weight), alone[:rows]), f"{kind}: {rows} rows differ from the rows alone"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread takes every group of the weight
    try:
        assert torch.equal(product(x, weight), alone), f"{kind}: {most} rows on one thread differ from the rows alone"
    finally:
        torch.set_num_threads(threads)


@needs_kernels
def test_a_weight_of_one_row_and_inputs_of_one_block_take_the_tiles_too(cpu_kernels_loaded):
    for kind in packed.PACKED_TYPES:
        weight = random_weight(kind, 1, in_features_for(kind, 1), seed=2)
        x = torch.randn(40, weight.in_features, generator=torch.Generator().manual_seed(2))
        got = product(x, weight)
        assert_operator_result(got, x, weight)
        assert torch.equal(got, torch.cat([product(x[r:r + 1], weight) for r in range(40)]))


_VARIANT_SCRIPT = OPERATOR_VARIANT_LOAD + """
cases = torch.load(sys.argv[1])
torch.save([torch.ops.llama_chat_cpu.packed_product(x, data, kind) for kind, x, data in cases], sys.argv[2])
"""


@needs_kernels
@pytest.mark.slow
@pytest.mark.parametrize("flags, takes_away", [("-mno-avx512f", "__AVX512F__"), ("-mno-avx", "__AVX__")],
                         ids=["avx2", "scalar"])
def test_builds_without_avx512_or_avx_agree_on_many_rows(cpu_kernels_loaded, tmp_path, flags, takes_away,
                                                         operator_variant_env):
    # The AVX2 build's tiles (vpmaddubsw pairs summed as int16, Q8_0 by the sign trick) give the
    # vector paths' bits, this build's among them; the scalar build sums in another order.
    skip_where_the_native_build_lacks(takes_away)
    cases = [case(kind, 130, seed=20 + i) for i, kind in enumerate(packed.PACKED_TYPES)]
    torch.save([(w.kind, x, w.data) for x, w in cases], tmp_path / "cases.pt")
    run = run_python(_VARIANT_SCRIPT, str(tmp_path / "cases.pt"), str(tmp_path / "out.pt"),
                     env=operator_variant_env(flags), cwd=tmp_path, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-2000:]
    for (x, weight), got in zip(cases, torch.load(tmp_path / "out.pt")):
        assert_operator_result(got, x, weight)
        if takes_away != "__AVX__" and cpu_kernels_loaded:
            assert torch.equal(got, product(x, weight)), f"{weight.kind}: the {flags} build differs from this one"
