"""Small GGUF models whose chat template is hostile: `pagevis run` refuses each at load in one line naming the
bound it went over, within the hostile checks' bounds (60 s, an address space of 1.5 GiB for the process, the
template's worker within its own 512 MiB). The template's worker is a separate process, so the model's own
process never runs the template at all."""

from __future__ import annotations

import time

import pytest
from gguf import GGUFReader
from test_hostile_files import HOSTILE, assert_one_line_refusal, run_cli

TEMPLATES = {
    "loop-no-output": ("{% for a in 'x' * 100000 %}{% for b in 'x' * 100000 %}{% endfor %}{% endfor %}",
                       "ran longer than 3 s"),
    "lipsum": ("{{ lipsum(10**6) }}", "ran longer than 3 s"),
    "power": ("{{ 9 ** (9 ** 9) }}", "a number of more than 65536 bits"),
    "repeat": ("{{ 'x' * 10**9 }}", "a value of 1000000000 items"),
    "center": ("{{ 'x' | center(10**9) }}", "ran out of memory (its limit is 512 MiB)"),
    "flood": ("{% for i in range(80000) %}<|im_end|>{% endfor %}{% for m in messages %}{{ m.content }}{% endfor %}",
              "is more than 16384 tokens (pagevis's cap: the model's context"),  # 93 s of prefill into a 96-token cache, before
    "cut": ("{% for m in messages %}{{ m.content[:3] if m.content == 'Hello, how are you?' else m.content }}"
            "{% endfor %}", "cannot be split into its own text and the messages'"),
}


SLOW = {"loop-no-output", "lipsum", "power", "repeat"}  # test_chat_template.py has each in-process


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in sorted(TEMPLATES)])
def test_run_refuses_a_hostile_template_at_load_in_one_line(name):
    source, bound = TEMPLATES[name]
    path = HOSTILE / f"template-{name}.gguf"  # written by scripts/make_hostile_files.py from TEMPLATES
    assert source in GGUFReader(path).fields["tokenizer.chat_template"].contents()
    started = time.monotonic()
    result = run_cli("run", "--model", str(path), "--max-tokens", "2", "--quiet")
    assert time.monotonic() - started < 60
    assert_one_line_refusal(result, path.name)
    assert bound in result.stderr
