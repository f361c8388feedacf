"""CheckpointReader: every parameter found, every checkpoint tensor used, or one error naming all."""

import pytest
import torch

from pdserve.model.weights import CheckpointReader


def test_reader_copies_and_reports_missing_and_unexpected():
    r = CheckpointReader([("model.a", torch.ones(2)), ("b", torch.zeros(3)), ("rotary_emb.inv_freq", torch.ones(1))])
    p = torch.zeros(2)
    r.copy(p, "a")
    assert torch.equal(p, torch.ones(2))
    assert r.take("c") is None and r.take("d", required=False) is None
    with pytest.raises(ValueError,
                       match=r"model_type 'llama': 1 missing \(e.g. \['c'\]\), 1 unexpected \(e.g. \['b'\]\)"):
        r.finish("llama")


def test_reader_shape_mismatch_names_both_shapes():
    r = CheckpointReader([("w", torch.zeros(3, 4))])
    with pytest.raises(ValueError, match=r"w: expected shape \(4, 3\), got \(3, 4\)"):
        r.copy(torch.zeros(4, 3), "w")


def test_complete_checkpoint_finishes_cleanly():
    r = CheckpointReader([("w", torch.zeros(2))])
    r.copy(torch.zeros(2), "w")
    r.finish("llama")
