"""The console's one-line errors (eagle3_data.logs.clip_line): whole when short, else clipped at word boundaries
with the log file they name kept whole."""

from __future__ import annotations

from eagle3_data.logs import clip_line


def test_a_short_line_is_whole():
    text = "backend 'or': environment variable OR_KEY (api_key_env) is not set or empty"
    assert clip_line(text) == text and clip_line(text, limit=len(text)) == text


def test_a_long_line_keeps_whole_words_and_the_log_it_names():
    words = [f"w{i:03d}" for i in range(150)]
    text = "backend 'or': " + " ".join(words) + " (its output: logs/generate/chat/000.server-or.log), rerun"
    out = clip_line(text, limit=400)
    assert len(out) <= 400 and " ... " in out
    head, tail = out.split(" ... ")
    assert tail == "logs/generate/chat/000.server-or.log), rerun"
    assert all(w in words for w in head.split()[2:])  # no word cut in two
    assert head.startswith("backend 'or': w000 w001")
    # no log named: the start and the end, each cut between words
    plain = " ".join(words)
    out = clip_line(plain, limit=120)
    head, tail = out.split(" ... ")
    assert len(out) <= 120 and head.split() == words[: len(head.split())]
    assert tail.split() == words[-len(tail.split()) :]
