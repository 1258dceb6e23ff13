import os
import re

README = os.path.join(os.path.dirname(__file__), "..", "README.md")


def test_readme_api_example_runs(capsys):
    with open(README) as f:
        text = f.read()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert blocks, "README lost its API example"
    exec(compile(blocks[0], "README.md", "exec"), {})
    assert "[[" in capsys.readouterr().out
