"""SamplingParams: validation messages name the value, greedy semantics, generation-config defaults."""

from __future__ import annotations

import math

import pytest
from transformers import GenerationConfig

from common.engine.sampling_params import SamplingParams


def test_defaults_are_valid_and_sample() -> None:
    params = SamplingParams()
    params.validate(vocab_size=100)
    assert not params.greedy
    assert not params.uses_penalties


@pytest.mark.parametrize(
    ("kwargs", "greedy"),
    [
        ({"temperature": 0.0}, True),
        ({"temperature": 0}, True),
        ({"temperature": 1e-6}, True),
        ({"temperature": 1e-5}, False),
        ({"top_k": 1}, True),
        ({"top_k": 2}, False),
        ({"temperature": 0.7, "top_p": 0.9}, False),
    ],
)
def test_greedy(kwargs: dict, greedy: bool) -> None:
    assert SamplingParams(**kwargs).greedy is greedy


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -0.5}, "temperature must be >= 0, got -0.5"),
        ({"temperature": math.nan}, "temperature must be finite, got nan"),
        ({"temperature": math.inf}, "temperature must be finite, got inf"),
        ({"temperature": True}, "temperature must be a number, got True"),
        ({"temperature": "1"}, "temperature must be a number, got '1'"),
        ({"top_p": 0.0}, "top_p must be > 0, got 0.0"),
        ({"top_p": 1.5}, "top_p must be <= 1, got 1.5"),
        ({"top_k": -2}, "top_k must be >= -1, got -2"),
        ({"top_k": 1.5}, "top_k must be an int, got 1.5"),
        ({"min_p": -0.1}, "min_p must be >= 0, got -0.1"),
        ({"min_p": 1.01}, "min_p must be <= 1, got 1.01"),
        ({"max_new_tokens": 0}, "max_new_tokens must be >= 1, got 0"),
        ({"max_new_tokens": True}, "max_new_tokens must be an int, got True"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be > 0, got 0.0"),
        ({"repetition_penalty": -1}, "repetition_penalty must be > 0, got -1"),
        ({"presence_penalty": 2.5}, "presence_penalty must be <= 2, got 2.5"),
        ({"presence_penalty": -2.5}, "presence_penalty must be >= -2, got -2.5"),
        ({"frequency_penalty": math.nan}, "frequency_penalty must be finite, got nan"),
        ({"logprobs": 21}, "logprobs must be <= 20, got 21"),
        ({"logprobs": -1}, "logprobs must be >= 0, got -1"),
        ({"seed": True}, "seed must be an int, got True"),
        ({"seed": 2**64}, f"seed must be <= {2**64 - 1}, got {2**64}"),
        ({"stop": ("ok", "")}, "stop strings must not be empty, got '' at index 1"),
        ({"stop": tuple(str(i) for i in range(17))}, "stop must hold at most 16 strings, got 17"),
        ({"stop": ("ok", 3)}, "stop strings must be str, got 3"),
        ({"stop_token_ids": (5, 99999)}, "unknown stop token id 99999 (vocab size 4096)"),
        ({"stop_token_ids": (-1,)}, "unknown stop token id -1 (vocab size 4096)"),
        ({"ignore_eos": 1}, "ignore_eos must be a bool, got 1"),
    ],
)
def test_validate_names_field_and_value(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs).validate(vocab_size=4096)
    assert str(info.value) == message


def test_an_empty_stop_string_is_named_without_the_others() -> None:
    # The message becomes a gRPC status, whose details past 16 KiB kill the stream (RESOURCE_EXHAUSTED).
    with pytest.raises(ValueError) as info:
        SamplingParams(stop=("z" * 100_000, "")).validate()
    assert str(info.value) == "stop strings must not be empty, got '' at index 1"


def test_ints_accepted_for_floats_and_bounds_inclusive() -> None:
    SamplingParams(temperature=2, top_p=1, min_p=1, presence_penalty=-2, frequency_penalty=2).validate()
    SamplingParams(top_k=-1, logprobs=0, seed=-(2**63), stop_token_ids=(4095,)).validate(vocab_size=4096)
    SamplingParams(logprobs=20, seed=2**64 - 1, stop=tuple("abcdefghijklmnop")).validate()


def test_stop_token_ids_unchecked_without_vocab_size() -> None:
    SamplingParams(stop_token_ids=(99999,)).validate()


def test_sequences_normalised_to_tuples_and_hashable() -> None:
    params = SamplingParams(stop="###", stop_token_ids=[1, 2])  # type: ignore[arg-type]
    assert params.stop == ("###",)
    assert params.stop_token_ids == (1, 2)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")  # type: ignore[arg-type]
    assert hash(params) == hash(SamplingParams(stop=("###",), stop_token_ids=(1, 2)))


def test_uses_penalties() -> None:
    assert SamplingParams(repetition_penalty=1.1).uses_penalties
    assert SamplingParams(presence_penalty=-0.5).uses_penalties
    assert SamplingParams(frequency_penalty=0.1).uses_penalties
    assert not SamplingParams(temperature=0.3, top_k=5, logprobs=3).uses_penalties


def test_from_generation_config_sampling() -> None:
    config = GenerationConfig(do_sample=True, temperature=0.6, top_p=0.9, repetition_penalty=1.05)
    params = SamplingParams.from_generation_config(config, temperature=None, max_new_tokens=32)
    assert params == SamplingParams(max_new_tokens=32, temperature=0.6, top_p=0.9, repetition_penalty=1.05)


def test_from_generation_config_user_overrides_win() -> None:
    config = GenerationConfig(do_sample=True, temperature=0.6, top_p=0.9, top_k=20)
    params = SamplingParams.from_generation_config(config, temperature=0.8, top_k=None, seed=3)
    assert params == SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=3)


def test_from_generation_config_without_do_sample_is_greedy() -> None:
    config = GenerationConfig(temperature=0.6, top_p=0.9)  # do_sample unset: generate() is greedy
    params = SamplingParams.from_generation_config(config)
    assert params == SamplingParams(temperature=0.0)
    assert params.greedy


def test_from_generation_config_user_temperature_beats_greedy_config() -> None:
    config = GenerationConfig(do_sample=False, top_p=0.5)
    params = SamplingParams.from_generation_config(config, temperature=0.7)
    assert params == SamplingParams(temperature=0.7)  # the greedy config's top_p is not taken


def test_from_generation_config_none_and_unknown_override() -> None:
    assert SamplingParams.from_generation_config(None, stop=["x"]) == SamplingParams(temperature=0.0, stop=("x",))
    with pytest.raises(ValueError, match=r"unknown sampling parameter\(s\) \['temprature'\]"):
        SamplingParams.from_generation_config(None, temprature=0.5)
