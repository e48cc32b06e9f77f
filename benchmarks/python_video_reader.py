"""The Python side of video_reader_vs_pyav: PyAV (what torchvision.io.read_video wraps) decoding
every frame of each clip to RGB (`frame.to_ndarray(format="rgb24")`), the clips one after another
in one process, PyAV's default decoder threading.
Usage: python_video_reader.py DIR; writes 8 H.264 clips of 49 frames at 320x240 into DIR when they
are not there, and prints {"seconds_per_step": ...} for one pass over them (the best of three)."""
import json
import pathlib
import sys
import time

import av
import numpy as np


def write_clips(folder: pathlib.Path):
    for k in range(8):
        with av.open(str(folder / f"clip{k}.mp4"), "w") as out:
            s = out.add_stream("libx264", rate=8)
            s.width, s.height, s.pix_fmt = 320, 240, "yuv420p"
            s.options = {"crf": "20"}
            y, x = np.mgrid[0:240, 0:320]
            for t in range(49):
                img = np.stack([(x + 5 * t + 20 * k) % 256, (y + 3 * t) % 256,
                                ((x // 16 + y // 16 + t) % 2) * 200], -1).astype(np.uint8)
                for p in s.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                    out.mux(p)
            for p in s.encode():
                out.mux(p)


def main():
    folder = pathlib.Path(sys.argv[1])
    folder.mkdir(parents=True, exist_ok=True)
    if len(list(folder.glob("clip*.mp4"))) < 8:
        write_clips(folder)
    files = sorted(folder.glob("clip*.mp4"))
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for f in files:
            with av.open(str(f)) as c:
                frames = [fr.to_ndarray(format="rgb24") for fr in c.decode(video=0)]
                assert len(frames) == 49
        best = min(best, time.perf_counter() - start)
    print(json.dumps({"seconds_per_step": best}))


if __name__ == "__main__":
    main()
