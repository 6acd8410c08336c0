"""Reward composition: correctness ±1 + soft overlong penalty, components per sample."""

import torch

from dapo_mega.config import AlgoConfig
from dapo_mega.reward import SampleReward, build_verifier, compute_rewards


def test_correctness_plus_overlong_penalty():
    # L_max = 20, L_cache = 4 → penalty starts after 16 tokens
    algo = AlgoConfig(max_response_length=20, overlong_buffer_length=4, overlong_penalty_factor=1.0)
    responses = [" 46\n", " 45\n", " 46\n", " 45 and on and on"]
    lengths = [4, 4, 18, 20]
    batch = compute_rewards(build_verifier("dapo"), responses, ["46"] * 4, lengths, algo,
                            answer_prefixes=["Answer:"] * 4)
    # correctness: +1, -1, +1, -1 ; penalty: 0, 0, (16-18)/4 = -0.5, -1 (truncated at L_max)
    torch.testing.assert_close(batch.correctness, torch.tensor([1.0, -1.0, 1.0, -1.0]))
    torch.testing.assert_close(batch.overlong_penalty, torch.tensor([0.0, 0.0, -0.5, -1.0]))
    # reward = sum: 1, -1, 0.5, -2 (a truncated wrong answer scores -2)
    torch.testing.assert_close(batch.reward, torch.tensor([1.0, -1.0, 0.5, -2.0]))
    assert batch.correct.tolist() == [True, False, True, False]
    assert batch.verifier_error == [None] * 4
    rec = batch.items()[3]
    assert rec == SampleReward(reward=-2.0, correct=False, correctness=-1.0, overlong_penalty=-1.0,
                               verifier="dapo", verifier_version=batch.verifier_version, verifier_error=None,
                               extracted="45andonandon")
    assert rec.components() == {"correctness": -1.0, "overlong_penalty": -1.0}
    assert [r.reward for r in batch.items()] == [1.0, -1.0, 0.5, -2.0]
    assert batch.stats.num_responses == 4


def test_overlong_shaping_off():
    algo = AlgoConfig(max_response_length=20, overlong_buffer_length=4, overlong_buffer_enable=False)
    batch = compute_rewards(build_verifier("dapo"), ["Answer: 1", "Answer: 2"], ["1", "1"], [20, 25], algo)
    torch.testing.assert_close(batch.overlong_penalty, torch.zeros(2))
    torch.testing.assert_close(batch.reward, torch.tensor([1.0, -1.0]))
