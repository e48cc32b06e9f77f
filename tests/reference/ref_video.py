"""Golden values for the video reader (data/video_file.hpp): small clips written with PyAV in
several containers, codecs, bit depths and chroma layouts, and every frame as PyAV decodes it
(`frame.to_ndarray(format="rgb24")`, what torchvision.io gives), plus a file with audio alone.

    video/<name>                  the clips
    video/frames.safetensors      <name> -> (T, H, W, 3) uint8
    video.json                    per clip: frames, fps, codec, size
    video_vfr.mp4 + video_vfr.json  a variable-frame-rate clip: its frame times, PyAV's average
                                  rate and every frame
    video_sampling.json           frame indices as train_cogvideox_lora.py and the SAT
                                  SFTDataset choose them, over a sweep of clip lengths, frame
                                  rates, windows and skips
    video/sat_crops.safetensors   resize_for_rectangle_crop(center) of the H.264 clip's frames
    video_buckets.json            finetrainers' video bucket choice (frames, size, frame indices)
                                  over clip lengths, sizes, bucket lists and frame limits
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
    "av1.mp4": ("mp4", "libsvtav1", "yuv420p", 48, 40, 6, 8),
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
    import os
    import av
    os.environ.setdefault("SVT_LOG", "1")  # SVT-AV1's banner and warnings: errors only
    with av.open(str(path), "w", format=fmt) as out:
        s = out.add_stream(codec, rate=fps)
        s.width, s.height, s.pix_fmt = w, h, pix_fmt
        if codec == "libx264":
            s.options = {"crf": "18"}
        if codec == "libx265":
            s.options = {"x265-params": "log-level=error"}
        if codec == "libsvtav1":
            s.options = {"crf": "20"}
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


def write_vfr(path):
    """H.264 in MP4 whose frame durations vary (1/30 s to 1/5 s): a variable frame rate."""
    import av
    from fractions import Fraction
    gaps = [1, 1, 2, 6, 1, 3, 1, 1, 4, 2, 1, 5]  # in 1/30 s
    times = np.concatenate([[0], np.cumsum(gaps)])
    with av.open(str(path), "w", format="mp4") as out:
        s = out.add_stream("libx264", rate=30)
        s.width, s.height, s.pix_fmt = 48, 32, "yuv420p"
        s.codec_context.time_base = Fraction(1, 30)
        s.options = {"crf": "18"}
        for t, pts in enumerate(times):
            f = av.VideoFrame.from_ndarray(picture(t, 48, 32), format="rgb24")
            f.pts, f.time_base = int(pts), Fraction(1, 30)
            for p in s.encode(f):
                out.mux(p)
        for p in s.encode():
            out.mux(p)
    with av.open(str(path)) as f:
        st = f.streams.video[0]
        frames, stamps = [], []
        for fr in f.decode(st):
            frames.append(fr.to_ndarray(format="rgb24"))
            stamps.append(float(fr.time))
        return np.stack(frames), stamps, float(st.average_rate)


def diffusers_indices(count, max_num_frames, skip_start, skip_end):
    """train_cogvideox_lora.py's VideoDataset._preprocess_data (frame choice), as indices."""
    start = min(skip_start, count)
    end = max(0, count - skip_end)
    if end <= start:
        idx = [min(start, count - 1)]  # the script reads frame `start`: the last one at most
    elif end - start <= max_num_frames:
        idx = list(range(start, end))
    else:
        idx = list(range(start, end, (end - start) // max_num_frames))
    idx = idx[:max_num_frames]
    remainder = (3 + (len(idx) % 4)) % 4
    return idx[:len(idx) - remainder] if remainder else idx


def sat_indices(count, actual_fps, fps, max_num_frames, skip):
    """The SAT SFTDataset.__getitem__'s frame choice and pad_last_frame, as indices. Where SAT
    fails (a zero stride, an index past the clip, an empty span) the last frame / stride 1 / the
    frame at the skip is taken instead."""
    if count / actual_fps * fps > max_num_frames:
        num_frames = max_num_frames
        start = int(skip)
        end = int(start + num_frames / fps * actual_fps)
        idx = np.arange(start, end, max((end - start) // num_frames, 1)).astype(int)
    elif count > max_num_frames:
        start = int(skip)
        end = int(count - skip)
        idx = np.arange(start, end, max((end - start) // max_num_frames, 1)).astype(int)
    else:
        def nearest_smaller_4k_plus_1(n):
            remainder = n % 4
            return n - 3 if remainder == 0 else n - remainder + 1
        start = int(skip)
        end = int(count - skip)
        n = end - start
        idx = np.arange(start, start + (nearest_smaller_4k_plus_1(n) if n >= 1 else 0))
    idx = [min(int(i), count - 1) for i in idx] or [min(skip, count - 1)]
    if len(idx) < max_num_frames:
        idx = idx + [idx[-1]] * (max_num_frames - len(idx))
    return idx[:max_num_frames]


def finetrainers_bucket(count, height, width, buckets, max_num_frames):
    """finetrainers' VideoDatasetWithResizing._preprocess_video: the frame bucket, the frame
    indices and the nearest resolution."""
    filtered = [res for res in buckets if res[0] <= count]
    nearest_frames = min(filtered, key=lambda x: abs(x[0] - min(count, max_num_frames)),
                         default=[1])[0]
    indices = list(range(0, count, count // nearest_frames))[:nearest_frames]
    nearest = min(buckets, key=lambda x: abs(x[1] - height) + abs(x[2] - width))
    return [nearest_frames, nearest[1], nearest[2]], indices


def bucket_sweep():
    lists = [[(49, 480, 720)],
             [(49, 480, 720), (49, 720, 480), (17, 480, 720), (33, 512, 512)],
             [(9, 32, 32), (13, 32, 48), (5, 48, 32), (9, 64, 64)],
             [(81, 768, 1360), (49, 768, 1360), (17, 768, 1360), (49, 1360, 768)]]
    cases = []
    for buckets in lists:
        for count in [1, 4, 5, 9, 12, 13, 17, 30, 49, 50, 100, 240]:
            for h, w in [(32, 32), (40, 48), (480, 720), (720, 480), (1080, 1920), (500, 500)]:
                for m in [9, 49, 81]:
                    shape, idx = finetrainers_bucket(count, h, w, buckets, m)
                    cases.append({"buckets": buckets, "count": count, "height": h, "width": w,
                                  "max_num_frames": m, "shape": shape, "frames": idx})
    return cases


def sampling_sweep():
    cases = []
    for count in [1, 2, 3, 4, 5, 8, 9, 12, 13, 17, 25, 48, 49, 50, 51, 60, 97, 98, 100, 147, 150,
                  200, 301]:
        for actual in [5.0, 8.0, 23.976023976023978, 24.0, 30.0, 60.0]:
            for fps in [8.0, 16.0]:
                for m in [9, 13, 49]:
                    for skip in [0, 3]:
                        cases.append({"count": count, "actual_fps": actual, "fps": fps,
                                      "max_num_frames": m, "skip": skip,
                                      "sat": sat_indices(count, actual, fps, m, skip)})
    for count in [1, 2, 3, 5, 9, 10, 48, 49, 50, 100, 201]:
        for m in [1, 5, 9, 49]:
            for a, b in [(0, 0), (3, 0), (0, 3), (2, 5), (60, 0)]:
                cases.append({"count": count, "max_num_frames": m, "skip_start": a,
                              "skip_end": b, "diffusers": diffusers_indices(count, m, a, b)})
    return cases


def sat_crops(frames):
    """resize_for_rectangle_crop(arr, size, reshape_mode="center") of the SAT data code."""
    import torch
    from torchvision.transforms import InterpolationMode
    from torchvision.transforms.functional import resize
    arr = torch.from_numpy(frames).permute(0, 3, 1, 2).contiguous()
    out = {}
    for h, w in [(32, 32), (24, 40), (40, 24), (48, 64), (20, 30), (96, 80)]:
        x = arr
        if x.shape[3] / x.shape[2] > w / h:
            x = resize(x, size=[h, int(x.shape[3] * h / x.shape[2])],
                       interpolation=InterpolationMode.BICUBIC)
        else:
            x = resize(x, size=[int(x.shape[2] * w / x.shape[3]), w],
                       interpolation=InterpolationMode.BICUBIC)
        top, left = (x.shape[2] - h) // 2, (x.shape[3] - w) // 2
        out[f"{h}x{w}"] = x[:, :, top:top + h, left:left + w].contiguous().numpy()
    return out


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
    save_file(sat_crops(tensors["h264_420.mp4"]), str(folder / "sat_crops.safetensors"))
    vfr, stamps, rate = write_vfr(folder / "vfr.mp4")
    save_file({"frames": np.ascontiguousarray(vfr)}, str(folder / "vfr_frames.safetensors"))
    (out / "video_vfr.json").write_text(json.dumps({"times": stamps, "average_rate": rate}))
    (out / "video_sampling.json").write_text(json.dumps(sampling_sweep()))
    (out / "video_buckets.json").write_text(json.dumps(bucket_sweep()))


if __name__ == "__main__":
    import sys
    generate(pathlib.Path(sys.argv[1]))
