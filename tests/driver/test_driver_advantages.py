"""The advantage step: kept groups -> TrainSamples, against hand-computed DAPO Eq. 9 values."""

import math

from helpers_driver import group

from dapo_mega.config import AlgoConfig
from dapo_mega.driver.advantages import build_train_samples


def test_group_advantages_tokens_and_masks():
    # group a: rewards 1, -1, -1, 1 -> mean 0, unbiased std sqrt(4/3) -> +-0.8660
    # group b: rewards 1, 1, 1, -2 -> mean 0.25, deviations .75 .75 .75 -2.25, var (3*.5625+5.0625)/3 = 2.25
    algo = AlgoConfig(overlong_filter=True)
    groups = [group("a", [1.0, -1.0, -1.0, 1.0], prompt_input=[5, 6]),
              group("b", [1.0, 1.0, 1.0, -2.0], prompt_input=[7], truncated=[False, False, False, True])]
    samples = build_train_samples(groups, algo)
    assert len(samples) == 8
    a = math.sqrt(3) / 2
    expected = [a, -a, -a, a, 0.5, 0.5, 0.5, -1.5]
    for s, want in zip(samples, expected):
        assert math.isclose(s.advantage, want, rel_tol=1e-5), (s.advantage, want)
    # the prompt ids the engine was given, the sampled tokens, the engine's log-probs
    assert samples[0].prompt_ids == [5, 6] and samples[4].prompt_ids == [7]
    assert samples[1].response_ids == [11, 11] and samples[1].engine_log_probs == [-0.5, -0.5]
    # overlong filter: the truncated response carries no loss; the others the default (all)
    assert samples[7].loss_mask == [0, 0] and samples[6].loss_mask is None


def test_no_std_normalisation_and_empty():
    algo = AlgoConfig(normalize_adv_std=False, overlong_filter=False)
    samples = build_train_samples([group("a", [1.0, -1.0, 0.0], truncated=[True, False, False])], algo)
    assert [s.advantage for s in samples] == [1.0, -1.0, 0.0]
    assert samples[0].loss_mask is None  # overlong filter off: truncated samples train too
    assert build_train_samples([], algo) == []
