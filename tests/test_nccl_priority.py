"""The ring says once per process group when NCCL runs at normal priority (ringfa4.nccl_options):
its transfers can then wait for whole kernels. Checked with stand-in groups, no GPU needed."""
import types
import warnings

import pytest

from ringfa4.ring import comm


def _group(high=None):
    """A stand-in process group whose CUDA backend has the given priority option (None: no options)."""
    backend = types.SimpleNamespace() if high is None else types.SimpleNamespace(
        options=types.SimpleNamespace(is_high_priority_stream=high))
    return types.SimpleNamespace(_get_backend=lambda device: backend)


def _warnings(group):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        comm._warn_unless_high_priority(group)
    return [str(w.message) for w in caught]


def test_normal_priority_group_warns_once_naming_the_fix(monkeypatch):
    monkeypatch.delenv("TORCH_NCCL_HIGH_PRIORITY", raising=False)
    group = _group(high=False)
    first = _warnings(group)
    assert len(first) == 1 and "pg_options=ringfa4.nccl_options()" in first[0]
    assert _warnings(group) == []


@pytest.mark.parametrize("high,env", [(True, None), (False, "1"), (None, None)],
                         ids=["high-priority-options", "env-variable", "not-nccl"])
def test_no_warning_when_priority_is_high_or_unknown(monkeypatch, high, env):
    if env is None:
        monkeypatch.delenv("TORCH_NCCL_HIGH_PRIORITY", raising=False)
    else:
        monkeypatch.setenv("TORCH_NCCL_HIGH_PRIORITY", env)
    assert _warnings(_group(high)) == []
