"""A request's sampling settings refuse what the engine cannot draw with, where they are
built, so that one bad request never fails the batch step it would join."""

from __future__ import annotations

import pytest

from serve_app.serving.samplers import SeededSampler, make_request_sampler
from serve_app.serving.sampling import SamplingParams


@pytest.mark.parametrize("seed", [-1, 2**64, True, 1.5])
def test_a_seed_outside_64_unsigned_bits_is_refused(seed):
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(max_tokens=4, temperature=1.0, seed=seed)


@pytest.mark.parametrize("seed", [0, 2**63, 2**64 - 1])
def test_seeds_at_the_edges_of_64_bits_draw(seed):
    import mlx.core as mx

    sampler = make_request_sampler(SamplingParams(max_tokens=4, temperature=1.0, seed=seed))
    assert isinstance(sampler, SeededSampler)
    token = sampler(mx.log(mx.array([[0.25, 0.25, 0.5]])))
    assert 0 <= token.item() < 3 and sampler.index == 1


def test_two_requests_with_one_seed_keep_samplers_of_their_own():
    a, b = (make_request_sampler(SamplingParams(max_tokens=4, temperature=1.0, seed=7))
            for _ in range(2))
    assert a is not b and a != b and len({a, b}) == 2  # identity: hashable, never equal
