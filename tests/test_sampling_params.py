import math

import pytest

from pagedllm.errors import RequestError
from pagedllm.sampling_params import BeamSearchParams, SamplingParams


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.best_of, p.temperature, p.top_p, p.top_k, p.min_p) == (1, None, 1.0, 1.0, 0, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.max_tokens, p.min_tokens, p.seed) == (16, 0, None)
    assert (p.stop, p.stop_token_ids, p.ignore_eos) == ([], [], False)
    assert (p.logprobs, p.prompt_logprobs, p.logit_bias) == (None, None, None)
    assert p.detokenize and p.skip_special_tokens and p.spaces_between_special_tokens
    assert not p.include_stop_str_in_output
    assert not p.is_greedy and p.num_samples == 1 and p.effective_top_k == 0


def test_normalisation():
    p = SamplingParams(stop="###", logit_bias={"5": 2}, top_k=-1, temperature=0.0, n=2, best_of=3)
    assert p.stop == ["###"]
    assert p.logit_bias == {5: 2.0}
    assert p.effective_top_k == 0
    assert p.is_greedy
    assert p.num_samples == 3


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("n", 0),
        ("n", 1.5),
        ("n", True),
        ("best_of", 0),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3.0),
        ("frequency_penalty", math.nan),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", math.nan),
        ("temperature", -0.1),
        ("temperature", math.nan),
        ("temperature", math.inf),
        ("temperature", "hot"),
        ("top_p", 0.0),
        ("top_p", 1.1),
        ("top_k", -2),
        ("top_k", 2.0),
        ("min_p", 1.5),
        ("max_tokens", 0),
        ("min_tokens", -1),
        ("logprobs", -1),
        ("prompt_logprobs", -1),
        ("stop", [""]),
        ("stop", 5),
        ("stop_token_ids", [-1]),
        ("stop_token_ids", 7),
        ("seed", "abc"),
        ("logit_bias", {"x": 1.0}),
        ("logit_bias", {1: math.inf}),
        ("logit_bias", {-1: 1.0}),
        ("logit_bias", [1, 2]),
        ("extra_args", [1]),
        ("extra_args", {1: "a"}),
        ("extra_args", {"a": {"b": object()}}),
        ("extra_args", {"a": [2**64]}),
    ],
)
def test_invalid_values_raise_request_error_naming_the_field(field, value):
    with pytest.raises(RequestError) as info:
        SamplingParams(**{field: value})
    assert info.value.param == field
    assert isinstance(info.value, ValueError)


def test_cross_field_checks():
    with pytest.raises(RequestError) as info:
        SamplingParams(n=3, best_of=2)
    assert info.value.param == "best_of"
    with pytest.raises(RequestError) as info:
        SamplingParams(max_tokens=4, min_tokens=5)
    assert info.value.param == "min_tokens"
    with pytest.raises(RequestError) as info:
        SamplingParams(detokenize=False, stop=["x"])
    assert info.value.param == "stop"


def test_max_tokens_none_is_allowed():
    assert SamplingParams(max_tokens=None, min_tokens=100).max_tokens is None


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"beam_width": 0, "max_tokens": 4}, "beam_width"),
        ({"beam_width": 2, "max_tokens": 0}, "max_tokens"),
        ({"beam_width": 2, "max_tokens": 4, "temperature": -1.0}, "temperature"),
        ({"beam_width": 2, "max_tokens": 4, "length_penalty": math.nan}, "length_penalty"),
        ({"beam_width": 2, "max_tokens": 4, "early_stopping": "sometimes"}, "early_stopping"),
    ],
)
def test_beam_search_params_validation(kwargs, field):
    with pytest.raises(RequestError) as info:
        BeamSearchParams(**kwargs)
    assert info.value.param == field


def test_extra_args_are_kept_for_custom_code():
    """vLLM's extra_args: JSON-like values under string keys, carried and read by nothing built in."""
    args = {"k": [1, 2.5, None, True, {"n": -(2**63)}], "s": "x"}
    assert SamplingParams(extra_args=args).extra_args == args
    assert SamplingParams().extra_args is None
    looped: list = []
    looped.append(looped)
    with pytest.raises(RequestError, match="more than 100000"):
        SamplingParams(extra_args={"loop": looped})
