"""The py-spy summary's arithmetic on a small collapsed-stack file written here."""

from __future__ import annotations

from benchmarks.pyspy_summary import short, summarise


def test_shares_per_thread_self_and_inclusive(tmp_path):
    f = tmp_path / "Router.1.txt"
    f.write_text(
        "thread (1): loop;run (/x/asyncio/base_events.py:10);handle (/app/router.py:5);parse (/app/body.py:7) 6\n"
        "thread (1): loop;run (/x/asyncio/base_events.py:10);handle (/app/router.py:9) 2\n"
        "thread (2): pool;work (/x/thread.py:3) 2\n")
    text = summarise(f, top=5)
    assert "10 samples" in text
    assert "| thread (1): loop | 0.80 |" in text and "| thread (2): pool | 0.20 |" in text
    assert "| parse (body.py) | 0.600 |" in text  # self
    assert "| handle (router.py) | 0.800 |" in text  # inclusive: lines 5 and 9 are one function
    assert short("f (/a/b/c.py:12)") == "f (c.py)"
