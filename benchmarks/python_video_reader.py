"""The Python side of the video benchmarks, PyAV (what torchvision.io.read_video wraps) decoding
every frame of each clip to RGB (`frame.to_ndarray(format="rgb24")`, PyAV's default decoder
threading):
  reader  video_reader_vs_pyav: clips 0-7 one after another in one process, the best of three
          passes;
  loader  video_loader_vs_torch_dataloader: all 16 clips, one (49, 240, 320, 3) uint8 tensor per
          clip, through torch's DataLoader with 2 worker processes (persistent, warmed by a pass),
          as a training script feeds its loop; the mean pass over at least 2 s.
Usage: python_video_reader.py DIR [reader|loader]; writes 16 H.264 clips of 49 frames at 320x240
into DIR when they are not there, and prints {"seconds_per_step": ...} for one pass."""
import json
import pathlib
import sys
import time

import av
import numpy as np
import torch

CLIPS = 16


def write_clips(folder: pathlib.Path):
    for k in range(CLIPS):
        with av.open(str(folder / f"clip{k:02d}.mp4"), "w") as out:
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


def read(path) -> np.ndarray:
    with av.open(str(path)) as c:
        frames = [fr.to_ndarray(format="rgb24") for fr in c.decode(video=0)]
    assert len(frames) == 49
    return np.stack(frames)


class Clips(torch.utils.data.Dataset):
    def __init__(self, files):
        self.files = files

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        return torch.from_numpy(read(self.files[i]))


def main():
    folder = pathlib.Path(sys.argv[1])
    mode = sys.argv[2] if len(sys.argv) > 2 else "reader"
    folder.mkdir(parents=True, exist_ok=True)
    if len(list(folder.glob("clip*.mp4"))) != CLIPS:
        for f in folder.glob("clip*.mp4"):
            f.unlink()
        write_clips(folder)
    files = sorted(folder.glob("clip*.mp4"))
    if mode == "reader":
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            for f in files[:8]:
                read(f)
            best = min(best, time.perf_counter() - start)
        print(json.dumps({"seconds_per_step": best}))
        return
    torch.set_num_threads(1)
    loader = torch.utils.data.DataLoader(Clips(files), batch_size=None, num_workers=2,
                                         persistent_workers=True)
    for _ in loader:  # workers started, files in the page cache
        pass
    steps, start = 0, time.perf_counter()
    while steps < 3 or time.perf_counter() - start < 2.0:
        for clip in loader:
            assert clip.shape == (49, 240, 320, 3)
        steps += 1
    print(json.dumps({"seconds_per_step": (time.perf_counter() - start) / steps}))


if __name__ == "__main__":
    main()
