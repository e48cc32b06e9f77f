"""Python's strict UTF-8 decoder on every string of one to four bytes drawn from the bytes where
UTF-8's rules change (ASCII, continuation bounds, the lead bytes of overlong forms, surrogates and
code points past U+10FFFF): whether bytes.decode("utf-8") accepts it, and if not, the offset of
the first byte it refuses (UnicodeDecodeError.start). The C++ test compares io::first_invalid_utf8
on every one of them (168,420 strings).
"""
import itertools
import json
import pathlib

BYTES = [0x00, 0x41, 0x7F, 0x80, 0x8F, 0x90, 0x9F, 0xA0, 0xBF, 0xC0, 0xC1, 0xC2, 0xDF, 0xE0,
         0xED, 0xEE, 0xEF, 0xF0, 0xF4, 0xF5, 0xFF]


def generate(out: pathlib.Path) -> None:
    results = []
    for n in range(1, 5):
        for combo in itertools.product(BYTES, repeat=n):
            try:
                bytes(combo).decode("utf-8")
                results.append(-1)
            except UnicodeDecodeError as e:
                results.append(e.start)
    (out / "utf8.json").write_text(json.dumps({"bytes": BYTES, "first_invalid": results}))


if __name__ == "__main__":
    import sys
    generate(pathlib.Path(sys.argv[1]))
