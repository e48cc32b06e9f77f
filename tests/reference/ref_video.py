"""Golden values for the video reader (data/video_file.hpp): small clips written with PyAV in
several containers, codecs, bit depths and chroma layouts, and every frame as PyAV decodes it
(`frame.to_ndarray(format="rgb24")`, what torchvision.io gives), plus a file with audio alone.

    video/<name>                  the clips
    video/frames.safetensors      <name> -> (T, H, W, 3) uint8
    video.json                    per clip: frames, fps, codec, size
"""
import json
import math
import pathlib

import numpy as np

CLIPS = {
    # name: (container format, codec, pixel format, width, height, frames, fps)
    "h264_420.mp4": ("mp4", "libx264", "yuv420p", 64, 48, 10, 8),
    "hevc_10bit.mkv": ("matroska", "libx265", "yuv420p10le", 32, 32, 6, 12),
    "vp9_444_odd.webm": ("webm", "libvpx-vp9", "yuv444p", 33, 27, 6, 10),
    "mpeg4.avi": ("avi", "mpeg4", "yuv420p", 32, 24, 5, 5),
}


def picture(t, w, h):
    """A gradient with a red square moving right: every frame differs, colours are saturated."""
    y, x = np.mgrid[0:h, 0:w]
    img = np.stack([(x * 255 // max(1, w - 1)), (y * 255 // max(1, h - 1)),
                    np.full_like(x, (t * 40) % 256)], -1).astype(np.uint8)
    side = max(4, min(w, h) // 3)
    x0 = (t * 3) % max(1, w - side)
    img[h // 3:h // 3 + side, x0:x0 + side] = (230, 20, 30)
    return img


def write_clip(path, fmt, codec, pix_fmt, w, h, frames, fps):
    import av
    with av.open(str(path), "w", format=fmt) as out:
        s = out.add_stream(codec, rate=fps)
        s.width, s.height, s.pix_fmt = w, h, pix_fmt
        if codec == "libx264":
            s.options = {"crf": "18"}
        if codec == "libx265":
            s.options = {"x265-params": "log-level=error"}
        for t in range(frames):
            f = av.VideoFrame.from_ndarray(picture(t, w, h), format="rgb24")
            for p in s.encode(f):
                out.mux(p)
        for p in s.encode():
            out.mux(p)


def write_audio_only(path):
    import av
    with av.open(str(path), "w", format="mp4") as out:
        s = out.add_stream("aac", rate=8000)
        samples = (np.sin(np.arange(8000) / 8000 * 2 * math.pi * 440) * 3000).astype(np.int16)
        frame = av.AudioFrame.from_ndarray(samples[None], format="s16", layout="mono")
        frame.sample_rate = 8000
        for p in s.encode(frame):
            out.mux(p)
        for p in s.encode():
            out.mux(p)


def decode(path):
    import av
    with av.open(str(path)) as f:
        s = f.streams.video[0]
        frames = [fr.to_ndarray(format="rgb24") for fr in f.decode(s)]
        return np.stack(frames), float(s.average_rate or 0), s.codec_context.name


def generate(out: pathlib.Path):
    from safetensors.numpy import save_file
    folder = out / "video"
    folder.mkdir(parents=True, exist_ok=True)
    info, tensors = {}, {}
    for name, (fmt, codec, pix, w, h, n, fps) in CLIPS.items():
        write_clip(folder / name, fmt, codec, pix, w, h, n, fps)
        frames, rate, decoder = decode(folder / name)
        tensors[name] = np.ascontiguousarray(frames)
        info[name] = {"frames": int(frames.shape[0]), "fps": rate, "codec": decoder,
                      "width": w, "height": h, "pix_fmt": pix}
    write_audio_only(folder / "audio_only.m4a")
    save_file(tensors, str(folder / "frames.safetensors"))
    (out / "video.json").write_text(json.dumps(info, indent=1))


if __name__ == "__main__":
    import sys
    generate(pathlib.Path(sys.argv[1]))
