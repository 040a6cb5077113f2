import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    """The calibration tests run models of a few thousand parameters: a second thread only adds synchronization,
    and on a busy 2-core host OpenMP's waits made each forward pass about 100x slower (0.35 s vs 2 ms)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
