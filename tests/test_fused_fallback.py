"""A GPU whose Triton or driver cannot build or run the fused kernels: the first use tries every kernel once
(commlab/engine/compressors/fused.py ``smoke``), and a failure leaves the process on the eager codecs, said once, with
the reason kept. Runs anywhere: the device is stood in for."""
import warnings

import pytest
import torch

from commlab.engine.compressors import fused


@pytest.fixture
def a_gpu(monkeypatch):
    monkeypatch.setattr(fused, "_capable", {})
    monkeypatch.setattr(fused, "problem", {})
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (9, 0))
    monkeypatch.setattr(fused, "_import", lambda: True)
    monkeypatch.delenv("COMMLAB_FUSED", raising=False)


def test_kernels_that_fail_their_first_run_leave_the_eager_codecs(a_gpu, monkeypatch):
    def broken(device):
        raise RuntimeError("PassManager::run failed\n(the rest of the compiler's report)")
    monkeypatch.setattr(fused, "smoke", broken)
    cuda0 = torch.device("cuda", 0)
    with pytest.warns(RuntimeWarning, match=r"failed on cuda:0 \(RuntimeError: PassManager::run failed\); "
                                            r"the eager codecs run there instead"):
        assert not fused.on(cuda0, torch.float32)
    assert fused.problem == {0: "RuntimeError: PassManager::run failed"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once: the answer is kept
        assert not fused.on(cuda0, torch.float32)


def test_kernels_that_run_are_taken(a_gpu, monkeypatch):
    ran = []
    monkeypatch.setattr(fused, "smoke", ran.append)
    assert fused.on(torch.device("cuda", 0), torch.float32) and fused.on(torch.device("cuda", 0), torch.float32)
    assert ran == [torch.device("cuda", 0)] and not fused.problem  # tried once per device
    assert not fused.on(torch.device("cuda", 0), torch.float16)
