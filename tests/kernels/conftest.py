import pytest

from kimi_perf_kernels.common import gpu_tiles


@pytest.fixture(params=["whole", "gpu"])
def tiles(request):
    """Launch with the interpreter's whole-dimension tiles (every tile loop runs once), or
    with a GPU's (the loops run over several tiles, as they do there)."""
    if request.param == "gpu":
        with gpu_tiles():
            yield request.param
    else:
        yield request.param
