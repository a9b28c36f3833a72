"""Sampler: greedy paths, truncation stages, penalties against HF, logprobs, seeded reproducibility."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from common.engine.sampler import (
    Sampler,
    SamplerOutput,
    apply_min_p,
    apply_penalties,
    mask_top_k_top_p,
    row_argmax,
    seeded_generator,
    token_counts,
)
from common.engine.sampling_params import SamplingParams

VOCAB = 64
SQRT_SUM = sum(math.sqrt(v) for v in (1, 2, 3, 4))


def _logits(num_rows: int, vocab_size: int = VOCAB, seed: int = 0) -> torch.Tensor:
    return torch.randn(num_rows, vocab_size, generator=torch.Generator().manual_seed(seed)) * 3  # [B, V]


def _run(
    sampler: Sampler,
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None] | None = None,
    prompts: list[list[int]] | None = None,
    outputs: list[list[int]] | None = None,
) -> SamplerOutput:
    """Call the sampler with per-row defaults: no generators, empty prompts and outputs."""
    n = len(params)
    return sampler(
        logits,
        params,
        generators if generators is not None else [None] * n,
        prompts if prompts is not None else [[] for _ in range(n)],
        outputs if outputs is not None else [[] for _ in range(n)],
    )


def test_greedy_fast_path_is_argmax_on_cpu_int64() -> None:
    logits = _logits(8).to(torch.bfloat16)
    out = _run(Sampler(seed=0), logits, [SamplingParams(temperature=0.0)] * 8)
    assert out.token_ids.dtype == torch.int64 and out.token_ids.device.type == "cpu"
    assert torch.equal(out.token_ids, logits.float().argmax(dim=-1))
    assert out.logprobs is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_argmax_breaks_ties_and_nans_as_argmax(dtype) -> None:
    """The sampler's argmax (``max(dim)`` on the CPU) picks what ``argmax`` picks: the first of tied maxima, the
    first NaN, index 0 of an all -inf row; on many random rows of few distinct values (ties everywhere)."""
    x = torch.zeros(6, 32000, dtype=dtype)
    x[:, [100, 20000, 31999]] = 1
    x[3, [7, 9000]] = float("nan")
    x[4, 31999] = 2
    x[5] = -float("inf")
    assert row_argmax(x).tolist() == x.argmax(dim=-1).tolist() == [100, 100, 100, 7, 31999, 0]
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        y = torch.randint(0, 4, (17, 5000), generator=g).to(dtype)
        assert torch.equal(row_argmax(y), y.argmax(dim=-1))


def test_empty_batch() -> None:
    out = _run(Sampler(seed=0), torch.empty(0, VOCAB), [])
    assert out.token_ids.shape == (0,) and out.logprobs is None


def test_row_count_mismatch_names_the_argument() -> None:
    with pytest.raises(ValueError, match="generators has 1 rows but logits have 2"):
        Sampler()(_logits(2), [SamplingParams()] * 2, [None], [[], []], [[], []])


def test_greedy_rows_mixed_with_sampled_rows_take_argmax() -> None:
    logits = _logits(6)
    params = [SamplingParams(temperature=0.0 if i % 2 == 0 else 1.5) for i in range(6)]
    out = _run(Sampler(seed=0), logits, params)
    assert out.token_ids[0::2].tolist() == logits.argmax(dim=-1)[0::2].tolist()


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(top_k=1, temperature=1.0),
        SamplingParams(temperature=1e-6),
        SamplingParams(top_p=1e-6, temperature=2.0),
        SamplingParams(min_p=1.0, temperature=2.0),
        SamplingParams(top_k=1, seed=5),
    ],
    ids=["top_k_1", "temperature_1e-6", "top_p_tiny", "min_p_1", "seeded_top_k_1"],
)
def test_degenerate_sampling_equals_greedy(params: SamplingParams) -> None:
    logits = _logits(100, seed=1)
    generators = [seeded_generator(params.seed) if params.seed is not None else None for _ in range(100)]
    out = _run(Sampler(seed=0), logits, [params] * 100, generators)
    assert torch.equal(out.token_ids, logits.argmax(dim=-1))


def test_sampling_is_not_greedy() -> None:
    # Guards the tests above: at temperature 1 over 100 rows of spread logits, sampling differs from argmax.
    logits = _logits(100, seed=1) / 3
    out = _run(Sampler(seed=0), logits, [SamplingParams(temperature=1.0)] * 100)
    assert not torch.equal(out.token_ids, logits.argmax(dim=-1))


def _frequencies(params: SamplingParams, probs: list[float], num_samples: int = 20000) -> list[float]:
    logits = torch.tensor(probs).log().expand(num_samples, -1).contiguous()  # [N, V]
    tokens = _run(Sampler(seed=123), logits, [params] * num_samples).token_ids
    return (torch.bincount(tokens, minlength=len(probs)).float() / num_samples).tolist()


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        (SamplingParams(temperature=1.0), [0.1, 0.2, 0.3, 0.4]),
        (SamplingParams(temperature=0.5), [1 / 30, 4 / 30, 9 / 30, 16 / 30]),  # p^2 renormalised
        (SamplingParams(temperature=2.0), [math.sqrt(v) / SQRT_SUM for v in (1, 2, 3, 4)]),  # sqrt(p) renormalised
        (SamplingParams(top_k=2), [0.0, 0.0, 3 / 7, 4 / 7]),
        (SamplingParams(top_p=0.65), [0.0, 0.0, 3 / 7, 4 / 7]),  # 0.4 < 0.65 keeps one more; 0.7 stops
        (SamplingParams(top_p=0.75), [0.0, 2 / 9, 3 / 9, 4 / 9]),
        (SamplingParams(min_p=0.6), [0.0, 0.0, 3 / 7, 4 / 7]),  # keeps p >= 0.24
        (SamplingParams(top_k=3, top_p=0.5), [0.0, 0.0, 3 / 7, 4 / 7]),  # top-p over top-k renormalised
    ],
    ids=["t1", "t0.5", "t2", "top_k2", "top_p0.65", "top_p0.75", "min_p0.6", "top_k3_top_p0.5"],
)
def test_sample_distribution(params: SamplingParams, expected: list[float]) -> None:
    # 20000 seeded draws: the standard error of each frequency is below 0.0036; 0.015 is > 4 sigma.
    frequencies = _frequencies(params, [0.1, 0.2, 0.3, 0.4])
    for got, want in zip(frequencies, expected):
        assert got == pytest.approx(want, abs=0.015)
        if want == 0.0:
            assert got == 0.0


def test_seeded_rows_reproducible_across_batches_and_row_orders() -> None:
    """A seeded request's tokens depend on its seed and logits only: not on its row, the other rows'
    params and seeds, the sampler's seed, or how many candidates the batch keeps (40, 100 or all)."""
    request = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, min_p=0.01, seed=7, frequency_penalty=0.3)
    others = [
        SamplingParams(temperature=1.3, seed=99),
        SamplingParams(temperature=0.0, repetition_penalty=1.2),
        SamplingParams(temperature=1.0, logprobs=2),
        SamplingParams(temperature=0.5, top_p=0.5),
    ]
    step_logits = [_logits(1, vocab_size=1000, seed=100 + step)[0] / 2 for step in range(12)]  # [V] each

    def generate(request: SamplingParams, position: int, batch: list[SamplingParams], sampler_seed: int) -> list[int]:
        sampler = Sampler(seed=sampler_seed)
        params = batch[:position] + [request] + batch[position:]
        generators = [seeded_generator(p.seed) if p.seed is not None else None for p in params]
        outputs: list[list[int]] = [[] for _ in params]
        for step, row in enumerate(step_logits):
            noise = _logits(len(params), vocab_size=1000, seed=step)
            logits = torch.cat([noise[:position], row.unsqueeze(0), noise[position + 1 :]])  # [B, V]
            tokens = _run(sampler, logits, params, generators, [[1, 2, 3]] * len(params), outputs).token_ids
            for ids, token in zip(outputs, tokens.tolist()):
                ids.append(token)
        return outputs[position]

    alone = generate(request, 0, [], sampler_seed=0)
    assert generate(request, 2, others, sampler_seed=1) == alone
    assert generate(request, 4, list(reversed(others)), sampler_seed=2) == alone
    assert generate(request, 1, others[2:], sampler_seed=3) == alone
    # Alone the candidates are its top 40; here the batch keeps the top 100 of every row.
    assert generate(request, 1, [SamplingParams(top_k=100, seed=5), SamplingParams(top_k=3)], sampler_seed=4) == alone
    assert generate(request.replace(seed=8), 0, [], sampler_seed=0) != alone  # the seed matters


def test_seeded_row_draws_exactly_vocab_exponentials_per_step() -> None:
    generator, reference = seeded_generator(11), seeded_generator(11)
    params = [SamplingParams(seed=11), SamplingParams(), SamplingParams(seed=3, temperature=0.0)]
    greedy_generator = seeded_generator(3)
    before = greedy_generator.get_state()
    for _ in range(3):
        _run(Sampler(seed=0), _logits(3, vocab_size=777), params, [generator, None, greedy_generator])
        torch.empty(777).exponential_(generator=reference)
    assert torch.equal(generator.get_state(), reference.get_state())
    assert torch.equal(greedy_generator.get_state(), before)  # greedy rows draw nothing


def test_unseeded_rows_follow_the_sampler_seed() -> None:
    logits = _logits(50, seed=4) / 3
    params = [SamplingParams(temperature=1.0)] * 50
    first, again = _run(Sampler(seed=1), logits, params), _run(Sampler(seed=1), logits, params)
    other = _run(Sampler(seed=2), logits, params)
    assert torch.equal(first.token_ids, again.token_ids)
    assert not torch.equal(first.token_ids, other.token_ids)


def test_repetition_penalty_matches_transformers() -> None:
    logits = _logits(3, seed=2)  # [B, V], mixed signs
    prompts = [[1, 5, 9], [2, 2, 63], [0, 10, 11]]
    outputs = [[5, 40], [7, 8], [11, 12]]
    hf = RepetitionPenaltyLogitsProcessor(penalty=1.3)(
        torch.tensor([p + o for p, o in zip(prompts, outputs)]), logits.clone()
    )
    seen = (token_counts(prompts, VOCAB, logits.device) + token_counts(outputs, VOCAB, logits.device)) > 0
    zeros = torch.zeros(3)
    counts = token_counts(outputs, VOCAB, logits.device)
    ours = apply_penalties(logits, torch.full((3,), 1.3), zeros, zeros, seen, counts)
    assert torch.equal(ours, hf)
    assert not torch.equal(ours, logits)
    # Through the sampler: greedy with the penalty takes the argmax of HF's penalised logits.
    boosted = logits.clone()
    boosted[torch.arange(3), torch.tensor([5, 63, 11])] = 20.0  # a seen token leads: the penalty matters
    hf_boosted = RepetitionPenaltyLogitsProcessor(penalty=9.0)(
        torch.tensor([p + o for p, o in zip(prompts, outputs)]), boosted.clone()
    )
    params = [SamplingParams(temperature=0.0, repetition_penalty=9.0)] * 3
    tokens = _run(Sampler(seed=0), boosted, params, prompts=prompts, outputs=outputs).token_ids
    assert torch.equal(tokens, hf_boosted.argmax(dim=-1))
    assert not torch.equal(tokens, boosted.argmax(dim=-1))


def test_presence_and_frequency_penalty_exact_values() -> None:
    logits = torch.tensor([[0.0, 2.0, -1.0, 1.0, 0.5, 3.0, 0.0, 0.0]])  # [1, 8]
    counts = token_counts([[3, 3, 5]], 8, logits.device)
    ours = apply_penalties(
        logits, torch.tensor([2.0]), torch.tensor([0.25]), torch.tensor([0.5]), counts > 0, counts
    )
    # token 3: 1 / 2 - 0.5 * 2 - 0.25 = -0.75; token 5: 3 / 2 - 0.5 - 0.25 = 0.75
    assert ours.tolist() == [[0.0, 2.0, -1.0, -0.75, 0.5, 0.75, 0.0, 0.0]]


def test_presence_and_frequency_count_output_tokens_only() -> None:
    logits = torch.tensor([[0.0, 1.0, 1.5]])  # token 2 leads by 0.5
    def token(params: SamplingParams, prompt: list[int], output: list[int]) -> int:
        return _run(Sampler(seed=0), logits, [params], prompts=[prompt], outputs=[output]).token_ids.item()
    assert token(SamplingParams(temperature=0.0, presence_penalty=1.0), [2, 2, 2], []) == 2
    assert token(SamplingParams(temperature=0.0, presence_penalty=1.0), [], [2]) == 1
    assert token(SamplingParams(temperature=0.0, frequency_penalty=0.2), [], [2, 2]) == 2  # 1.5 - 0.4 > 1
    assert token(SamplingParams(temperature=0.0, frequency_penalty=0.2), [], [2, 2, 2]) == 1  # 1.5 - 0.6 < 1
    assert token(SamplingParams(temperature=0.0, presence_penalty=-2.0), [], [0]) == 0  # negative rewards


def test_penalty_token_ids_outside_vocab_rejected() -> None:
    with pytest.raises(ValueError, match=r"token id 64 is outside the logits' vocabulary \[0, 64\)"):
        _run(Sampler(), _logits(1), [SamplingParams(presence_penalty=1.0)], outputs=[[1, 64]])


def test_logprobs_are_raw_log_softmax_with_sorted_top_n() -> None:
    logits = _logits(4, seed=3)
    params = [
        SamplingParams(temperature=0.3, logprobs=5, repetition_penalty=1.5),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, logprobs=0),
        SamplingParams(temperature=2.0, logprobs=20, seed=1),
    ]
    generators = [None, None, None, seeded_generator(1)]
    before = logits.clone()
    out = _run(Sampler(seed=0), logits, params, generators, prompts=[[1, 2]] * 4, outputs=[[3]] * 4)
    assert torch.equal(logits, before)  # the caller's logits are not modified
    expected = logits.log_softmax(dim=-1)  # raw: before penalties and temperature
    assert out.logprobs is not None and out.logprobs[1] is None
    for row, n in ((0, 5), (2, 0), (3, 20)):
        entry = out.logprobs[row]
        assert entry is not None
        assert entry.token_id == out.token_ids[row].item()
        assert entry.logprob == expected[row, entry.token_id].item()
        values, ids = expected[row].topk(n)
        assert entry.top_token_ids == ids.tolist() and entry.top_logprobs == values.tolist()
        assert entry.top_logprobs == sorted(entry.top_logprobs, reverse=True)
        assert len(entry.top_token_ids) == n


def test_mask_top_k_top_p_and_min_p_functions() -> None:
    sorted_logits = torch.tensor([[4.0, 3.0, 2.0, 1.0], [5.0, 0.0, 0.0, 0.0]])  # [2, 4], rows non-increasing
    inf = float("-inf")
    top_k = mask_top_k_top_p(sorted_logits, torch.tensor([2, 4]), None)
    assert top_k.tolist() == [[4.0, 3.0, inf, inf], [5.0, 0.0, 0.0, 0.0]]
    # Ties with the k-th logit are kept, as in HF's TopKLogitsWarper.
    ties = mask_top_k_top_p(sorted_logits, torch.tensor([4, 2]), None)
    assert ties.tolist() == [[4.0, 3.0, 2.0, 1.0], [5.0, 0.0, 0.0, 0.0]]
    # softmax of row 0 is [0.64, 0.24, 0.09, 0.03]: top_p 0.5 keeps one token, 0.7 two, 1.0 all.
    top_p = mask_top_k_top_p(sorted_logits, None, torch.tensor([0.5, 1.0]))
    assert top_p.tolist() == [[4.0, inf, inf, inf], [5.0, 0.0, 0.0, 0.0]]
    assert mask_top_k_top_p(sorted_logits[:1], None, torch.tensor([0.7])).tolist() == [[4.0, 3.0, inf, inf]]
    # top-p after top-k renormalises: alone, 0.64 + 0.24 = 0.88 < 0.9 keeps a third token; after top-3,
    # the probs are [0.67, 0.24, 0.09] and 0.67 + 0.24 = 0.91 >= 0.9 keeps two.
    assert mask_top_k_top_p(sorted_logits[:1], None, torch.tensor([0.9])).tolist() == [[4.0, 3.0, 2.0, inf]]
    both = mask_top_k_top_p(sorted_logits[:1], torch.tensor([3]), torch.tensor([0.9]))
    assert both.tolist() == [[4.0, 3.0, inf, inf]]
    logits = torch.tensor([[1.0, 4.0, 3.0, 2.0], [0.0, 0.0, 0.0, 5.0]])  # any order
    assert apply_min_p(logits, torch.tensor([0.0, 1.0])).tolist() == [[1.0, 4.0, 3.0, 2.0], [inf, inf, inf, 5.0]]
    # exp(3 - 4) = 0.37 >= 0.3 is kept, exp(2 - 4) = 0.14 is not
    assert apply_min_p(logits[:1], torch.tensor([0.3])).tolist() == [[inf, 4.0, 3.0, inf]]


def test_top_p_without_top_k_matches_with_top_k_of_vocab() -> None:
    # The full-sort path (top-p alone) and the candidate path (top-k bounds the candidates) agree.
    logits = _logits(200, seed=9) / 2
    params_a = [SamplingParams(top_p=0.8, seed=i) for i in range(200)]
    params_b = [SamplingParams(top_p=0.8, top_k=VOCAB - 1, seed=i) for i in range(200)]
    a = _run(Sampler(), logits, params_a, [seeded_generator(i) for i in range(200)])
    b = _run(Sampler(), logits, params_b, [seeded_generator(i) for i in range(200)])
    assert torch.equal(a.token_ids, b.token_ids)
