"""TensorBoard reads the event files difftrain writes, with its own readers: every scalar of a
trainer run (tag, step, value, wall-time order; the steps a resumed run logged again replace the
first run's), the sample grids decode to the images written, histograms' buckets sum to their
counts, the configuration table shows; a file cut at every byte of its last record still reads up
to the record before, and a flipped byte is the DataLossError TensorBoard reports.
Usage: check_cpp_tensorboard.py TEST_BINARY GOLDEN_DIR"""
import io
import json
import math
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

import numpy as np
from PIL import Image

try:
    from tensorboard.backend.event_processing import event_accumulator, event_file_loader
    from tensorboard.compat.tensorflow_stub import errors
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import PyRecordReader_New
    from tensorboard.util import tensor_util
except ImportError as e:  # a machine without the reference venv: reported as skipped (77), not passed
    print(f"skipped: TensorBoard's Python package is not installed ({e}); scripts/setup.sh installs it")
    sys.exit(77)


def main(binary, _golden_dir):
    out = pathlib.Path(tempfile.mkdtemp())
    env = dict(os.environ, DIFFTRAIN_TENSORBOARD_OUT=str(out))
    subprocess.run([binary, "--gtest_filter=TensorBoardFiles.TrainerRunForPythonReader"], check=True, env=env)
    want = json.loads((out / "expected.json").read_text())
    tb = out / "tb"

    acc = event_accumulator.EventAccumulator(str(tb), size_guidance={k: 0 for k in event_accumulator.DEFAULT_SIZE_GUIDANCE})
    acc.Reload()
    tags = acc.Tags()
    checked = 0
    # Two parameter groups (biases without weight decay): one LR tag each.
    for tag in ["train/loss", "train/lr/default", "train/lr/default/no_decay", "train/grad_norm",
                "train/ema_decay", "train/loss_scale"]:
        assert tag in tags["scalars"], (tag, tags["scalars"])
        events = acc.Scalars(tag)
        # Steps 1-6 from the first run, 7-12 once each from the resumed run (the first run's purged).
        assert [e.step for e in events] == list(range(1, 13)), (tag, [e.step for e in events])
        for e in events:
            row = (want["first_run"] if e.step <= 6 else want["steps"])[str(e.step)]
            row = dict(row, **{"train/lr/default": row["train/lr"], "train/lr/default/no_decay": row["train/lr"]})
            assert math.isclose(e.value, np.float32(row[tag]), rel_tol=1e-6, abs_tol=1e-12), (tag, e.step, e.value, row[tag])
            checked += 1
        walls = [e.wall_time for e in events]
        assert walls == sorted(walls), (tag, walls)
    for tag in ["perf/steps_per_second", "perf/samples_per_second", "train/skipped_steps"]:
        assert tag in tags["scalars"], tag
    sps = acc.Scalars("perf/steps_per_second")
    per_sample = {e.step: e.value for e in acc.Scalars("perf/samples_per_second")}
    for e in sps:
        assert e.value > 0 and math.isclose(per_sample[e.step], e.value * 5, rel_tol=1e-5), (e.step, e.value)

    # Images: the grids SampleEvery drew at steps 5 and 10.
    images = acc.Images("samples")
    assert [i.step for i in images] == [5, 10], [i.step for i in images]
    for i in images:
        got = np.asarray(Image.open(io.BytesIO(i.encoded_image_string)).convert("RGB"))
        expect = np.asarray(Image.open(out / f"samples-{i.step}.png").convert("RGB"))
        assert got.shape == expect.shape == (i.height, i.width, 3), (got.shape, expect.shape, i.height, i.width)
        assert np.array_equal(got, expect), i.step

    # Histograms: weights and gradients of every parameter every 4 steps.
    histo_tags = tags["histograms"]
    names = {"fc1.weight": 96, "fc1.bias": 16, "fc2.weight": 64, "fc2.bias": 4}
    for name, count in names.items():
        for kind in ["weights/", "gradients/"]:
            hs = acc.Histograms(kind + name)
            assert [h.step for h in hs] == [4, 8, 12], (kind + name, [h.step for h in hs])
            for h in hs:
                v = h.histogram_value
                assert v.num == count and sum(v.bucket) == count, (name, v.num, sum(v.bucket))
                assert len(v.bucket) == len(v.bucket_limit) and v.min <= v.max
    assert sum(names.values()) == want["parameters"]
    assert len(histo_tags) == 8, histo_tags

    # The configuration, as a Markdown table for the text plugin (in each run's file).
    texts = acc.Tensors("config")
    assert texts, tags["tensors"]
    md = tensor_util.make_ndarray(texts[0].tensor_proto).reshape(-1)[0].decode()
    assert "| model.hidden | 16 |" in md and "| model.act | silu\\|gelu |" in md, md

    # A file cut at every byte of its last record reads up to the record before it.
    files = sorted(tb.glob("events.out.tfevents.*"))
    assert len(files) == 2, files
    data = files[1].read_bytes()
    full = list(event_file_loader.EventFileLoader(str(files[1])).Load())
    last_len = len(full[-1].SerializeToString()) + 16
    cut_dir = out / "cut"
    cut_dir.mkdir()
    for cut in range(len(data) - last_len, len(data)):
        path = cut_dir / files[1].name
        path.write_bytes(data[:cut])
        got = list(event_file_loader.EventFileLoader(str(path)).Load())
        assert [e.SerializeToString() for e in got] == [e.SerializeToString() for e in full[:-1]], cut
    # A flipped byte in a record: TensorBoard's record reader raises DataLossError there.
    bad = bytearray(data)
    bad[len(data) - last_len + 20] ^= 0x40
    path = cut_dir / "events.out.tfevents.bad"
    path.write_bytes(bytes(bad))
    reader = PyRecordReader_New(str(path))
    raised = False
    try:
        for _ in range(len(full) + 1):
            reader.GetNext()
    except errors.DataLossError:
        raised = True
    assert raised, "a corrupted record read without error"
    shutil.rmtree(out)
    print(f"TensorBoard reads difftrain's event files ({checked} scalars, {len(images)} images, histograms, text)")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
