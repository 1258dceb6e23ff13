import pytest

from ddtree_jax.__main__ import main


def test_demo_runs_on_random_tiny(capsys):
    main(["demo", "--preset", "tiny", "--batch", "2", "--max-new-tokens", "4"])
    out = capsys.readouterr().out
    assert "method=ar batch=2 new_tokens=8" in out


def test_demo_on_hf_checkpoint(tmp_path, capsys):
    from ddtree_jax import checkpoint
    from tests.conftest import random_target, tiny

    checkpoint.save_hf(random_target(tiny()), tmp_path)
    main(["demo", "--checkpoint", str(tmp_path), "--batch", "1", "--max-new-tokens", "3"])
    assert "HF checkpoint" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["demo", "--checkpoint", "/no/such/dir"], "does not exist"),
        (["demo", "--checkpoint", __file__], "is a file, not a directory"),
        (["demo", "--preset", "huge"], "unknown preset 'huge'"),
        (["demo", "--preset", "kimi_k2"], "too large"),
    ],
)
def test_demo_errors(argv, match):
    with pytest.raises(SystemExit, match=match):
        main(argv)
