"""The Triton MLA decode kernel against the torch consumers and a float64 reference, every tier.

Run under triton's interpreter on CPU tensors (tests/attention/conftest.py), at small shapes:
B = 3 sequences of ragged lengths, one of them a single row; 3 splits of the context whose
boundaries fall inside a tile of BLOCK_T = 16 rows; rows of 64 + 16 values (32 + 8 for the
narrow case, where the rope key is narrower than the kernel's padded tile). Two references,
neither from the code under test:

- torch: `latentkv.attention.consumers.attend`, the consumers the engine runs on the CPU;
- float64: every row decoded by its codec (`Codec.decode`), then attention in float64.

Tolerances, relative to max(1, the reference's largest value): float32 products ("ieee")
within 2e-5 of both references (float32 rounding of sums of a few hundred terms; measured about
1e-6); bfloat16 operands within 5e-2 of the float64 one (each operand rounded by up to 2^-9,
which moves scores of a few units by about 1e-2 and the softmax with them; measured up to 3e-2).
"""

from __future__ import annotations

import pytest
import torch

from latentkv.attention import consumers
from latentkv.kv.codecs import TIERS, EncodedRows, get_codec

pytest.importorskip("triton")
from latentkv.attention.triton.decode import (  # noqa: E402  (after the importorskip)
    SequenceRows,
    mla_decode,
    pick_splits,
)

N_C, N_R = 64, 16  # kv_lora_rank, qk_rope_head_dim at test scale
H = 5  # heads: fewer than a block of 16, so the head mask is exercised
LENGTHS = (37, 1, 20)  # ragged; 37 in 3 splits of 13: boundaries at 13 and 26, inside tiles of 16
SPLITS, BLOCK_T = 3, 16
IEEE_TOL, BF16_TOL = 2e-5, 5e-2

# every tier the kernel serves, by its `--kv-cache-dtype` name (":g16": 16-value scale groups)
SERVED = [
    "f32", "bf16", "fp8", "fp8:g16", "q8_0", "q5_0", "q4_0", "q4_1", "q8s", "q5s", "q4s", "wq4",
    "hq8_0", "hq4_0", "tq2", "tq3", "tq4", "tq5", "tq6", "tq4:g16", "tq4-r8", "tq3-r16",
]  # fmt: skip


def codecs(tier: str, n_c: int = N_C, n_r: int = N_R):
    name, _, group = tier.partition(":g")
    group_size = int(group) if group else None
    t = TIERS[name]
    return (
        get_codec(t.c, n_c, group_size=group_size),
        get_codec(t.r, n_r, group_size=group_size if group_size and n_r % group_size == 0 else None),
    )


class Case:
    """B sequences of random rows stored in one tier, and a query per sequence."""

    def __init__(self, tier: str, lengths=LENGTHS, n_c=N_C, n_r=N_R, seed=0, device="cpu"):
        gen = torch.Generator().manual_seed(seed)
        self.tier, self.lengths, self.n_c = tier, list(lengths), n_c
        self.codec_c, self.codec_r = codecs(tier, n_c, n_r)
        self.q = 0.3 * torch.randn(len(lengths), H, n_c + n_r, generator=gen)  # [B, H, W] scaled
        self.encoded, self.stored = [], []
        for T in lengths:
            x = torch.randn(T, n_c + n_r, generator=gen)
            x[:, n_c:] *= 2.0  # the rope key on its own scale: c and r never share one
            c, r = self.codec_c.encode(x[:, :n_c]), self.codec_r.encode(x[:, n_c:])
            self.encoded.append((c, r))
            if tier == "f32":  # f32 rows live side by side [T, n_c + n_r]: the parts are strided views
                rows = torch.cat([c.codes.view(torch.float32), r.codes.view(torch.float32)], 1).to(device)
                self.stored.append(SequenceRows(rows[:, :n_c], None, rows[:, n_c:], None))
            else:
                self.stored.append(
                    SequenceRows(
                        c.codes.to(device), c.scales.to(device), r.codes.to(device), r.scales.to(device)
                    )
                )
        self.device = device

    def run(self, index=None, lengths=None, **kw):
        q = self.q.to(self.device)
        idx = None if index is None else index.to(self.device)
        out, lse = mla_decode(
            q, self.codec_c, self.codec_r, self.stored, lengths or self.lengths, idx, block_t=BLOCK_T, **kw
        )
        return out.cpu(), lse.cpu()

    def rows(self, b: int, index: torch.Tensor | None = None) -> tuple[EncodedRows, EncodedRows]:
        c, r = self.encoded[b]
        return (c, r) if index is None else (c.select(index), r.select(index))

    def torch_reference(self, b: int, index=None) -> torch.Tensor:
        c, r = self.rows(b, index)
        return consumers.attend(self.codec_c, self.codec_r, self.q[b].unsqueeze(1), c, r)[:, 0]  # [H, n_c]

    def f64_reference(self, b: int, index=None) -> tuple[torch.Tensor, torch.Tensor]:
        c, r = self.rows(b, index)
        rows = torch.cat([self.codec_c.decode(c), self.codec_r.decode(r)], 1).double()  # [T, W]
        s = self.q[b].double() @ rows.T  # [H, T]
        return torch.softmax(s, -1) @ rows[:, : self.n_c], torch.logsumexp(s, -1)


def close(out: torch.Tensor, ref: torch.Tensor, tol: float) -> float:
    """The largest error relative to the reference's largest value; asserts it is within tol."""
    err = float((out.double() - ref.double()).abs().max() / max(1.0, float(ref.abs().max())))
    assert err <= tol, f"error {err:.3g} > {tol}"
    return err


@pytest.mark.parametrize("tier", SERVED)
def test_split_decode_matches_both_references(tier, kernel_device):
    case = Case(tier, seed=SERVED.index(tier), device=kernel_device)
    out, lse = case.run(splits=SPLITS)
    for b in range(len(LENGTHS)):
        close(out[b], case.torch_reference(b), IEEE_TOL)
        ref, ref_lse = case.f64_reference(b)
        close(out[b], ref, IEEE_TOL)
        close(lse[b], ref_lse, IEEE_TOL)


@pytest.mark.parametrize("tier", ["f32", "fp8", "q4s", "tq4-r8"])
def test_one_split_writes_the_result_directly(tier, kernel_device):
    case = Case(tier, seed=100, device=kernel_device)
    one, one_lse = case.run(splits=1)
    many, many_lse = case.run(splits=5)  # more splits than some sequences have rows
    for b in range(len(LENGTHS)):
        close(one[b], case.f64_reference(b)[0], IEEE_TOL)
    close(one, many, IEEE_TOL)
    close(one_lse, many_lse, IEEE_TOL)


@pytest.mark.parametrize("tier", ["f32", "bf16", "fp8", "q8s", "q4s", "tq4"])
def test_dsa_gather_attends_only_the_selected_rows(tier, kernel_device):
    """index [B, K]: sequence b reads rows index[b, :count_b], in any order; the rest of its row
    (and every other row of the cache) is never read."""
    case = Case(tier, seed=200, device=kernel_device)
    gen = torch.Generator().manual_seed(201)
    counts = [23, 1, 7]
    K = max(counts)
    index = torch.full((len(LENGTHS), K), 10**6, dtype=torch.int32)  # past every cache: must stay unread
    picks = []
    for b, (T, k) in enumerate(zip(LENGTHS, counts, strict=True)):
        pick = torch.randperm(T, generator=gen)[:k]
        index[b, :k] = pick.to(torch.int32)
        picks.append(pick)
    out, _ = case.run(index=index, lengths=counts, splits=SPLITS)
    for b, pick in enumerate(picks):
        close(out[b], case.torch_reference(b, pick), IEEE_TOL)
        close(out[b], case.f64_reference(b, pick)[0], IEEE_TOL)


@pytest.mark.parametrize("tier", ["f32", "bf16", "fp8", "q4s", "tq4"])
def test_bf16_operands_stay_within_their_tolerance(tier, kernel_device):
    case = Case(tier, seed=300, device=kernel_device)
    out, lse = case.run(splits=SPLITS, precision="bf16")
    errors = []
    for b in range(len(LENGTHS)):
        ref, ref_lse = case.f64_reference(b)
        errors.append(close(out[b], ref, BF16_TOL))
        close(lse[b], ref_lse, BF16_TOL)
    assert max(errors) > IEEE_TOL  # the bf16 path did run: its rounding shows


@pytest.mark.parametrize("tier", ["fp8", "q8_0", "bf16", "q4_1"])
def test_narrow_and_uneven_widths(tier, kernel_device):
    """Rows of 24 + 8 (not powers of two, narrower than a 16-wide tile): the kernel pads and masks."""
    case = Case(tier, lengths=(9, 30), n_c=24, n_r=8, seed=400, device=kernel_device)
    out, _ = case.run(splits=2)
    for b in range(2):
        close(out[b], case.f64_reference(b)[0], IEEE_TOL)


@pytest.mark.parametrize("tier", ["q8_0", "q4s", "q4_1", "wq4"])
def test_block_rows_at_odd_addresses_are_read_byte_by_byte(tier, kernel_device):
    """Rows 2-byte aligned are read as 16-bit words; rows that are not (a view one byte into a
    wider buffer: odd address, odd stride) take the byte path, with the same result."""
    case = Case(tier, lengths=(19, 6), seed=450, device=kernel_device)
    odd = []
    for seq in case.stored:
        wide = torch.zeros(
            seq.c_codes.shape[0], seq.c_codes.shape[1] + 1, dtype=torch.uint8, device=kernel_device
        )
        wide[:, 1:] = seq.c_codes
        odd.append(SequenceRows(wide[:, 1:], seq.c_scales, seq.r_codes, seq.r_scales))
    even, _ = case.run(splits=2)
    case.stored = odd
    out, _ = case.run(splits=2)
    for b in range(2):
        close(out[b], case.f64_reference(b)[0], IEEE_TOL)
    close(out, even, IEEE_TOL)


def test_f32_rows_read_in_place_are_not_copied(kernel_device):
    """The kernel reads the cache's own tensors: change a row after building the inputs and the
    result follows it (a copy taken at launch would not)."""
    case = Case("fp8", lengths=(12,), seed=500, device=kernel_device)
    before, _ = case.run(splits=1)
    case.stored[0].c_scales.mul_(0)  # every row's latent scale zeroed: c reads as zeros
    after, _ = case.run(splits=1)
    assert float(before.abs().max()) > 0.1
    assert float(after.abs().max()) == 0.0


def test_rejects_rows_that_disagree_with_the_codec(kernel_device):
    case = Case("fp8", lengths=(4, 4), seed=600, device=kernel_device)
    c0 = case.stored[0]
    wrong = SequenceRows(c0.c_codes[:, :-1], c0.c_scales, c0.r_codes, c0.r_scales)
    with pytest.raises(ValueError, match="bytes each"):
        mla_decode(case.q, case.codec_c, case.codec_r, [wrong, case.stored[1]], case.lengths)
    with pytest.raises(ValueError, match="query"):
        mla_decode(case.q[:, :, :-1], case.codec_c, case.codec_r, case.stored, case.lengths)
    with pytest.raises(ValueError, match="precision"):
        mla_decode(case.q, case.codec_c, case.codec_r, case.stored, case.lengths, precision="fp4")


@pytest.mark.parametrize(
    ("programs", "rows", "sms", "expected"),
    [
        (132, 32768, 132, 1),  # the device is full without splitting
        (4, 32768, 132, 33),  # one sequence, 4 head blocks on an H200: 33 x 4 >= 132 programs
        (4, 100_000_000, 1000, 64),  # at most MAX_SPLITS
        (4, 1024, 132, 8),  # no split shorter than 4 tiles of 32 rows: 1024 / 128
        (4, 50, 132, 1),  # too short to split
        (1, 0, 132, 1),
    ],
)
def test_split_count_fills_the_device(programs, rows, sms, expected):
    assert pick_splits(programs, rows, sms, block_t=32) == expected
