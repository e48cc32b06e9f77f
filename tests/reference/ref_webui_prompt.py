"""The web UI's prompt-emphasis parser (modules/prompt_parser.py parse_prompt_attention, the regex
version difftrain follows: `:([+-]?[.\\d]+)\\)` for a weight, `\\s*\\bBREAK\\b\\s*` between
chunks) on 3,000 random prompts drawn from the characters that matter to it: brackets, colons,
backslashes, signs and dots, ASCII digits and other scripts' decimal digits (full-width, Arabic-
Indic, Devanagari: Python's `\\d` and float() read them), BREAK next to every kind of white space
Python's `\\s` knows (U+001C-U+001F among them), letters and CJK text. Prompts whose weight
float() refuses ("1.2.3") are recorded as refused. The C++ test compares every one.
"""
import json
import pathlib
import random
import re

re_attention = re.compile(r"""
\\\(|
\\\)|
\\\[|
\\]|
\\\\|
\\|
\(|
\[|
:([+-]?[.\d]+)\)|
\)|
]|
[^\\()\[\]:]+|
:
""", re.X)

re_break = re.compile(r"\s*\bBREAK\b\s*", re.S)


def parse_prompt_attention(text):
    res = []
    round_brackets = []
    square_brackets = []
    round_bracket_multiplier = 1.1
    square_bracket_multiplier = 1 / 1.1

    def multiply_range(start_position, multiplier):
        for p in range(start_position, len(res)):
            res[p][1] *= multiplier

    for m in re_attention.finditer(text):
        text = m.group(0)
        weight = m.group(1)
        if text.startswith('\\'):
            res.append([text[1:], 1.0])
        elif text == '(':
            round_brackets.append(len(res))
        elif text == '[':
            square_brackets.append(len(res))
        elif weight is not None and round_brackets:
            multiply_range(round_brackets.pop(), float(weight))
        elif text == ')' and round_brackets:
            multiply_range(round_brackets.pop(), round_bracket_multiplier)
        elif text == ']' and square_brackets:
            multiply_range(square_brackets.pop(), square_bracket_multiplier)
        else:
            parts = re.split(re_break, text)
            for i, part in enumerate(parts):
                if i > 0:
                    res.append(["BREAK", -1])
                res.append([part, 1.0])

    for pos in round_brackets:
        multiply_range(pos, round_bracket_multiplier)
    for pos in square_brackets:
        multiply_range(pos, square_bracket_multiplier)
    if len(res) == 0:
        res = [["", 1.0]]
    i = 0
    while i + 1 < len(res):
        if res[i][1] == res[i + 1][1]:
            res[i][0] += res[i + 1][0]
            res.pop(i + 1)
        else:
            i += 1
    return res


PIECES = ["(", ")", "[", "]", ":", "\\", "\\(", "\\)", ".", "+", "-", "1", "2", "0.5", "1.3",
          "１", "．", "２", "٣", "٫", "١", "५", "BREAK", " BREAK ", "\x1cBREAK\x1f", "\u2003BREAK\n",
          "\x1dBREAK", " ", "\t", "\x1e", "\u00a0", "cat", "a", "_", "東京", "é", ",", "x:1.5)",
          "(a:", "(b:", ".5.5)", ":1.2)", "０)", "١٢)"]


def generate(out: pathlib.Path):
    rng = random.Random(20261128)
    cases = []
    for _ in range(3000):
        prompt = "".join(rng.choice(PIECES) for _ in range(rng.randint(0, 14)))
        try:
            parts = parse_prompt_attention(prompt)
            cases.append({"prompt": prompt, "parts": [[t, float(w)] for t, w in parts]})
        except ValueError:  # float() of a weight such as "1.2.3"
            cases.append({"prompt": prompt, "refused": True})
    # The shapes the outside trial named, always present.
    for prompt in ("(word:１.２)", "(a:١.٥) b", "a\x1c BREAK\x1f b", "(x:+٣)", "[a:५]"):
        cases.append({"prompt": prompt, "parts": [[t, float(w)] for t, w in parse_prompt_attention(prompt)]})
    (out / "webui_prompt.json").write_text(json.dumps({"cases": cases}, ensure_ascii=False))
