// Watching a run: CRC-32C, TFRecord framing and its reader, TensorBoard event files (the reading
// back by TensorBoard itself is tests/reference/check_cpp_tensorboard.py, which runs
// TensorBoardFiles.TrainerRunForPythonReader), tensor histograms, the TensorBoard callback in a
// trainer, the progress line on a terminal and off one, and plots with labelled axes.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <difftrain/diffusion/ddim.hpp>
#include <difftrain/diffusion/sample.hpp>
#include <difftrain/io/remove_tree.hpp>
#include <difftrain/log/log.hpp>
#include <difftrain/train/train.hpp>
#if DIFFTRAIN_HAS_PLOT
#include <difftrain/log/plot.hpp>
#endif

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <thread>

#include "xy_batch.hpp"

namespace dt = difftrain;
namespace lg = difftrain::log;
namespace tr = difftrain::train;
namespace fs = std::filesystem;

namespace {

fs::path scratch(const std::string& name) {
  const fs::path dir = fs::temp_directory_path() / ("difftrain-log-" + std::to_string(::getpid()));
  fs::create_directories(dir);
  return dir / name;
}

// ---- protobuf reading, just enough to check what the writer wrote ------------------------------
struct Field {
  int number = 0, wire = 0;
  std::uint64_t varint = 0;
  std::string bytes;  // length-delimited, or the 4/8 fixed bytes
};
std::vector<Field> parse(const std::string& m) {
  std::vector<Field> out;
  std::size_t i = 0;
  auto varint = [&] {
    std::uint64_t v = 0;
    for (int shift = 0;; shift += 7) {
      const auto b = static_cast<unsigned char>(m.at(i++));
      v |= std::uint64_t{b & 0x7Fu} << shift;
      if ((b & 0x80) == 0) return v;
    }
  };
  while (i < m.size()) {
    Field f;
    const std::uint64_t key = varint();
    f.number = static_cast<int>(key >> 3);
    f.wire = static_cast<int>(key & 7);
    if (f.wire == 0)
      f.varint = varint();
    else if (f.wire == 1)
      f.bytes = m.substr(i, 8), i += 8;
    else if (f.wire == 5)
      f.bytes = m.substr(i, 4), i += 4;
    else if (f.wire == 2) {
      const auto n = static_cast<std::size_t>(varint());
      f.bytes = m.substr(i, n);
      i += n;
    } else
      throw std::runtime_error("unexpected wire type");
    out.push_back(f);
  }
  return out;
}
const Field* field(const std::vector<Field>& fs_, int n) {
  for (const auto& f : fs_)
    if (f.number == n) return &f;
  return nullptr;
}
double as_double(const Field& f) {
  std::uint64_t v = 0;
  std::memcpy(&v, f.bytes.data(), 8);
  return std::bit_cast<double>(v);
}
float as_float(const Field& f) {
  std::uint32_t v = 0;
  std::memcpy(&v, f.bytes.data(), 4);
  return std::bit_cast<float>(v);
}

}  // namespace

// ---- CRC-32C ------------------------------------------------------------------------------------

TEST(Crc32c, StandardCheckValueAndRfc3720Vectors) {
  EXPECT_EQ(lg::crc32c(std::string_view("123456789")), 0xE3069283u);  // the standard check value
  EXPECT_EQ(lg::crc32c(std::string(32, '\0')), 0x8A9136AAu);
  EXPECT_EQ(lg::crc32c(std::string(32, '\xff')), 0x62A8AB43u);
  std::string ascending, descending;
  for (int i = 0; i < 32; ++i)
    ascending += static_cast<char>(i), descending += static_cast<char>(31 - i);
  EXPECT_EQ(lg::crc32c(ascending), 0x46DD794Eu);
  EXPECT_EQ(lg::crc32c(descending), 0x113FDB5Cu);
  EXPECT_EQ(lg::crc32c(std::string_view()), 0u);
  // Every split of the input gives the same CRC (the slicing path and the byte path agree).
  const std::string text = "The quick brown fox jumps over the lazy dog, twice over.";
  for (std::size_t k = 0; k <= text.size(); ++k)
    EXPECT_EQ(lg::crc32c(std::string_view(text).substr(k),
                         lg::crc32c(std::string_view(text).substr(0, k))),
              lg::crc32c(text));
  for (std::uint32_t c : {0u, 1u, 0xE3069283u, 0xFFFFFFFFu})
    EXPECT_EQ(lg::unmask_crc(lg::mask_crc(c)), c);
  EXPECT_EQ(lg::mask_crc(0u), 0xA282EAD8u);
}

TEST(ProtoWriter, WireFormat) {
  lg::ProtoWriter w;
  w.int64(1, 300).int64(2, -1).bytes(3, "hi").f32(4, 1.5F).f64(5, -2.0);
  const std::string& b = w.str();
  const std::string want = std::string("\x08\xac\x02", 3) + "\x10" + std::string(9, '\xff') +
                           "\x01" + "\x1a\x02hi" + "\x25" + std::string("\x00\x00\xc0\x3f", 4) +
                           "\x29" + std::string("\x00\x00\x00\x00\x00\x00\x00\xc0", 8);
  EXPECT_EQ(b, want);
  const double v[] = {1.0, 2.0};
  const auto f = parse(lg::ProtoWriter().packed_f64(7, v).str());
  ASSERT_EQ(f.size(), 1U);
  EXPECT_EQ(f[0].wire, 2);
  EXPECT_EQ(f[0].bytes.size(), 16U);
}

// ---- TFRecord -----------------------------------------------------------------------------------

TEST(TfRecord, ReadsBackAndStopsAtATornLastRecordAtEveryOffset) {
  std::string file;
  const std::vector<std::string> records = {"first", std::string(300, 'x'), "", "last record"};
  for (const auto& r : records) lg::append_record(file, r);
  EXPECT_EQ(lg::TfRecordReader(file, "mem").all(), records);
  std::size_t last_start = file.size() - (16 + records.back().size());
  for (std::size_t cut = last_start; cut < file.size(); ++cut) {
    lg::TfRecordReader r(file.substr(0, cut), "mem");
    const auto got = r.all();
    EXPECT_EQ(got, std::vector<std::string>(records.begin(), records.end() - 1)) << cut;
    EXPECT_EQ(r.truncated(), cut > last_start) << cut;
  }
}

TEST(TfRecord, ABadChecksumIsAFormatErrorNamingTheOffset) {
  std::string file;
  lg::append_record(file, "alpha");
  lg::append_record(file, "beta");
  const std::size_t second = 16 + 5;
  for (std::size_t at : {second + 2, second + 9, second + 13, file.size() - 1}) {
    std::string bad = file;
    bad[at] = static_cast<char>(bad[at] ^ 0x20);
    lg::TfRecordReader r(bad, "run/events");
    EXPECT_EQ(r.next(), "alpha");
    try {
      (void)r.next();
      ADD_FAILURE() << "byte " << at << " flipped, no error";
    } catch (const dt::FormatError& e) {
      EXPECT_NE(std::string(e.what()).find("corrupted record at byte 21"), std::string::npos)
          << e.what();
      EXPECT_NE(std::string(e.what()).find("run/events"), std::string::npos) << e.what();
    }
  }
}

// ---- event files
// ----------------------------------------------------------------------------------

// event_files lists a run folder's event files (and nothing else, not in subfolders), sorted;
// remove_event_files clears them for a fresh run and leaves the rest.
TEST(EventFile, EventFilesAreListedAndRemovedLeavingOtherFiles) {
  const fs::path dir = scratch("events-list");
  (void)dt::io::remove_tree(dir);
  EXPECT_TRUE(lg::event_files(dir).empty());  // no folder: none
  {
    lg::EventFileWriter a(dir), b(dir);
    fs::create_directories(dir / "other_run");
    lg::EventFileWriter nested(dir / "other_run");
    std::ofstream(dir / "notes.txt") << "kept";
    const auto files = lg::event_files(dir);
    ASSERT_EQ(files.size(), 2U);
    EXPECT_TRUE(std::is_sorted(files.begin(), files.end()));
    EXPECT_TRUE((files[0] == a.path() && files[1] == b.path()) ||
                (files[0] == b.path() && files[1] == a.path()));
  }
  lg::remove_event_files(dir);
  EXPECT_TRUE(lg::event_files(dir).empty());
  EXPECT_TRUE(fs::exists(dir / "notes.txt"));
  EXPECT_EQ(lg::event_files(dir / "other_run").size(), 1U);
  (void)dt::io::remove_tree(dir);
}

TEST(EventFile, WritesFileVersionThenEventsAndFlushesOnATimer) {
  const fs::path dir = scratch("events-timer");
  (void)dt::io::remove_tree(dir);
  lg::EventFileWriter w(dir, {.flush_seconds = 0.05});
  EXPECT_EQ(w.path().parent_path(), dir);
  EXPECT_EQ(w.path().filename().string().rfind("events.out.tfevents.", 0), 0U);
  // The file version is in the file at once.
  auto recs = lg::TfRecordReader::open(w.path()).all();
  ASSERT_EQ(recs.size(), 1U);
  EXPECT_EQ(field(parse(recs[0]), 3)->bytes, "brain.Event:2");
  w.add_scalar("train/loss", 0.25, 7, 1000.5);
  // Not flushed by hand: the background flush puts it in the file within flush_seconds.
  for (int i = 0; i < 200 && lg::TfRecordReader::open(w.path()).all().size() < 2; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  recs = lg::TfRecordReader::open(w.path()).all();
  ASSERT_EQ(recs.size(), 2U);
  const auto e = parse(recs[1]);
  EXPECT_EQ(as_double(*field(e, 1)), 1000.5);
  EXPECT_EQ(field(e, 2)->varint, 7U);
  const auto value = parse(field(parse(field(e, 5)->bytes), 1)->bytes);
  EXPECT_EQ(field(value, 1)->bytes, "train/loss");
  EXPECT_EQ(as_float(*field(value, 2)), 0.25F);
  w.close();
  EXPECT_THROW(w.add_scalar("x", 1, 1), dt::IoError);
  w.close();  // idempotent
}

TEST(EventFile, HistogramTextImageAndSessionStartFields) {
  const fs::path dir = scratch("events-kinds");
  (void)dt::io::remove_tree(dir);
  fs::path path;
  {
    lg::EventFileWriter w(dir);
    path = w.path();
    w.add_histogram("h",
                    {.min = -1,
                     .max = 2,
                     .num = 3,
                     .sum = 1,
                     .sum_squares = 5,
                     .bucket_limit = {0, 2},
                     .bucket = {1, 2}},
                    3);
    w.add_text("config", "| a | b |", 3);
    dt::io::RgbImage img(4, 2, 200);
    w.add_image("img", img, 4);
    w.add_session_start(5);
  }  // the destructor flushes and closes
  const auto recs = lg::TfRecordReader::open(path).all();
  ASSERT_EQ(recs.size(), 5U);
  const auto histo =
      parse(field(parse(field(parse(field(parse(recs[1]), 5)->bytes), 1)->bytes), 5)->bytes);
  EXPECT_EQ(as_double(*field(histo, 3)), 3.0);
  EXPECT_EQ(field(histo, 6)->bytes.size(), 16U);
  const auto text = parse(field(parse(field(parse(recs[2]), 5)->bytes), 1)->bytes);
  EXPECT_EQ(parse(field(parse(field(text, 9)->bytes), 1)->bytes).at(0).bytes, "text");
  EXPECT_EQ(field(parse(field(text, 8)->bytes), 8)->bytes, "| a | b |");
  const auto image =
      parse(field(parse(field(parse(field(parse(recs[3]), 5)->bytes), 1)->bytes), 4)->bytes);
  EXPECT_EQ(field(image, 1)->varint, 2U);
  EXPECT_EQ(field(image, 2)->varint, 4U);
  EXPECT_EQ(dt::io::decode_png(
                std::span<const char>(field(image, 4)->bytes.data(), field(image, 4)->bytes.size()),
                "img")
                .image.pixels,
            dt::io::RgbImage(4, 2, 200).pixels);
  const auto session = parse(recs[4]);
  EXPECT_EQ(field(session, 2)->varint, 5U);
  EXPECT_EQ(field(parse(field(session, 7)->bytes), 1)->varint, 1U);  // START
}

TEST(EventFile, BadInputIsATypedError) {
  const fs::path dir = scratch("events-bad");
  (void)dt::io::remove_tree(dir);
  EXPECT_THROW(lg::EventFileWriter(dir, {.flush_seconds = 0}), dt::ConfigError);
  {
    lg::EventFileWriter w(dir);
    EXPECT_THROW(w.add_scalar("", 1, 1), dt::ConfigError);
    EXPECT_THROW(w.add_histogram("h", {.bucket_limit = {1}, .bucket = {}}, 1), dt::ShapeError);
    EXPECT_THROW(w.add_image("i", dt::io::RgbImage(), 1), dt::ShapeError);
    w.add_scalar("ok", 1, 1);
  }
  // What was written before the mistakes is in the file, whole.
  const auto files = [&] {
    std::vector<fs::path> v;
    for (const auto& e : fs::directory_iterator(dir)) v.push_back(e.path());
    return v;
  }();
  ASSERT_EQ(files.size(), 1U);
  EXPECT_EQ(lg::TfRecordReader::open(files[0]).all().size(), 2U);
  // A folder that cannot be made.
  std::ofstream(scratch("a-file")) << "x";
  EXPECT_THROW(lg::EventFileWriter(scratch("a-file") / "run"), dt::IoError);
}

TEST(Histogram, CountsEveryFiniteValueOnce) {
  at::manual_seed(0);
  const at::Tensor t = at::randn({1000}) * 3;
  const lg::Histogram h = lg::histogram_of(t, 17);
  ASSERT_EQ(h.bucket.size(), 17U);
  EXPECT_EQ(std::accumulate(h.bucket.begin(), h.bucket.end(), 0.0), 1000.0);
  EXPECT_EQ(h.num, 1000.0);
  EXPECT_DOUBLE_EQ(h.min, t.min().item<double>());
  EXPECT_DOUBLE_EQ(h.bucket_limit.back(), t.max().item<double>());
  EXPECT_NEAR(h.sum, t.to(at::kDouble).sum().item<double>(), 1e-9);
  EXPECT_NEAR(h.sum_squares, t.to(at::kDouble).square().sum().item<double>(), 1e-6);
  for (std::size_t i = 1; i < h.bucket_limit.size(); ++i)
    EXPECT_LT(h.bucket_limit[i - 1], h.bucket_limit[i]);
  // Non-finite values are left out; a constant tensor is one bucket; integers work.
  const lg::Histogram n = lg::histogram_of(at::tensor({1.0, std::nan(""), INFINITY, 3.0}), 4);
  EXPECT_EQ(n.num, 2.0);
  EXPECT_EQ(std::accumulate(n.bucket.begin(), n.bucket.end(), 0.0), 2.0);
  const lg::Histogram c = lg::histogram_of(at::full({5, 5}, 2.0F));
  EXPECT_EQ(c.bucket, std::vector<double>{25.0});
  EXPECT_EQ(lg::histogram_of(at::arange(10)).num, 10.0);
  EXPECT_EQ(lg::histogram_of(at::empty({0})).num, 0.0);
  EXPECT_THROW((void)lg::histogram_of(at::randn({3}), 0), dt::ConfigError);
  EXPECT_THROW((void)lg::histogram_of(at::Tensor()), dt::ConfigError);
}

// ---- the TensorBoard callback in a trainer
// ----------------------------------------------------------

namespace {

using TinyBatch = difftrain::test::XyBatch;
struct TinyNetImpl : torch::nn::Module {
  using Batch = TinyBatch;
  TinyNetImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(6, 16));
    fc2 = register_module("fc2", torch::nn::Linear(16, 4));
  }
  at::Tensor loss(const Batch& b) { return torch::mse_loss(fc2(torch::silu(fc1(b.x))), b.y); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};

// The images a sampling callback would draw: a function of the step, so the test knows them.
at::Tensor images_for(std::int64_t step) {
  return at::linspace(-1, 1, 3 * 8 * 8).reshape({3, 1, 8, 8}) *
         (1.0 - 0.1 * static_cast<double>(step % 7));
}
struct DrawSamples {
  template <class T>
  at::Tensor operator()(T& t) const {
    return images_for(t.global_step());
  }
};

// What each step reported, to compare with what the event file holds.
struct Recorder {
  nlohmann::json* rows;
  template <class T>
  void on_step_end(T& t, const tr::StepInfo& s) {
    if (!s.stepped) return;
    (*rows)[std::to_string(s.step)] = {{"train/loss", s.loss},
                                       {"train/lr", s.lr.front()},
                                       {"train/grad_norm", s.grad_norm},
                                       {"train/ema_decay", t.ema().last_decay()},
                                       {"train/loss_scale", t.scaler().current_scale()},
                                       {"samples", s.samples}};
  }
};

struct TensorBoardConfig : tr::DefaultConfig {
  using Schedule = dt::schedule::Cosine;
  using Ema = dt::ema::Ema<dt::ema::WarmupDecay>;
  using Precision = tr::AutocastFp16;
  using Callbacks =
      std::tuple<tr::TensorBoard, tr::SampleEvery<DrawSamples>, tr::CheckpointEvery, Recorder>;
};
using TbTrainer = tr::Trainer<TinyNetImpl, TensorBoardConfig>;

TbTrainer::Options tb_options() {
  TbTrainer::Options o;
  o.optimizer.lr = 3e-3;
  o.schedule = {3, 12, 0.5};
  o.ema.rule.decay = 0.99;
  o.ema.rule.use_ema_warmup = true;
  o.clipping.max_norm = 1.0;
  o.scaler.init_scale = 1024;
  return o;
}

TinyBatch tiny_batch(std::int64_t step, std::int64_t /*micro*/) {
  at::Generator g = at::detail::createCPUGenerator(static_cast<std::uint64_t>(step) + 11);
  return {at::randn({5, 6}, g), at::randn({5, 4}, g)};
}

}  // namespace

// Trains 12 steps with everything on, then resumes from step 6 and trains 6..12 again, into the
// same folder. With DIFFTRAIN_TENSORBOARD_OUT set it works there and writes expected.json and
// the expected sample grids for check_cpp_tensorboard.py.
TEST(TensorBoardFiles, TrainerRunForPythonReader) {
  const char* env = std::getenv("DIFFTRAIN_TENSORBOARD_OUT");
  const fs::path out = env != nullptr ? fs::path(env) : scratch("tensorboard-run");
  (void)dt::io::remove_tree(out);
  const nlohmann::json config = {{"lr", 3e-3}, {"model", {{"hidden", 16}, {"act", "silu|gelu"}}}};
  nlohmann::json first, second;
  auto callbacks = [&](nlohmann::json& rows) {
    return TensorBoardConfig::Callbacks{
        tr::TensorBoard({.dir = out / "tb", .histograms_every = 4, .config = config}),
        tr::SampleEvery<DrawSamples>(5, DrawSamples{}, "samples", {.columns = 3}),
        tr::CheckpointEvery({.dir = out / "ckpt", .every = 6, .keep_last = 5}), Recorder{&rows}};
  };
  {
    torch::manual_seed(0);
    TinyNetImpl net;
    TbTrainer t(net, tb_options(), callbacks(first));
    t.fit(tiny_batch, 12);
  }
  std::int64_t parameters = 0;
  {
    torch::manual_seed(1);  // other initial weights: the resumed run must take the checkpoint's
    TinyNetImpl net;
    for (const auto& p : net.parameters()) parameters += p.numel();
    TbTrainer t(net, tb_options(), callbacks(second));
    t.load_checkpoint(out / "ckpt" / "checkpoint-6.pt");
    t.fit(tiny_batch, 12);
  }
  ASSERT_EQ(first.size(), 12U);
  ASSERT_EQ(second.size(), 6U);
  for (const auto& [step, row] : second.items()) {
    EXPECT_EQ(row["samples"], 5);
    EXPECT_DOUBLE_EQ(row["train/loss"].get<double>(), first[step]["train/loss"].get<double>())
        << step;
  }
  // Two event files; the second starts with a session start at step 7.
  std::vector<fs::path> files;
  for (const auto& e : fs::directory_iterator(out / "tb")) files.push_back(e.path());
  std::sort(files.begin(), files.end());
  ASSERT_EQ(files.size(), 2U);
  const auto recs = lg::TfRecordReader::open(files[1]).all();
  ASSERT_GE(recs.size(), 3U);
  const auto session = parse(recs[2]);  // file version, config text, then the session start
  ASSERT_NE(field(session, 7), nullptr);
  EXPECT_EQ(field(session, 2)->varint, 7U);

  nlohmann::json expected = {{"steps", second}, {"first_run", first}, {"parameters", parameters}};
  for (std::int64_t step : {5, 10}) {
    const fs::path png = out / ("samples-" + std::to_string(step) + ".png");
    dt::io::write_png(png, dt::io::image_grid(images_for(step), {.columns = 3}));
  }
  std::ofstream(out / "expected.json") << expected.dump(1);
}

TEST(TensorBoardFiles, OnlyRankZeroWritesAndBadOptionsAreErrors) {
  EXPECT_THROW(tr::TensorBoard({.scalars_every = 0}), dt::ConfigError);
  EXPECT_THROW(tr::TensorBoard({.histograms_every = -1}), dt::ConfigError);
  EXPECT_THROW(tr::TensorBoard({.histogram_buckets = 0}), dt::ConfigError);
  // A folder that cannot be written stops the run before its first step (the trainer's
  // constructor).
  std::ofstream(scratch("tb-file")) << "x";
  struct Cfg : tr::DefaultConfig {
    using Callbacks = std::tuple<tr::TensorBoard>;
  };
  TinyNetImpl net;
  EXPECT_THROW((tr::Trainer<TinyNetImpl, Cfg>(
                   net, {}, {tr::TensorBoard({.dir = scratch("tb-file") / "x"})})),
               dt::IoError);
  EXPECT_EQ(tr::markdown_table({{"a", {{"b", 1}}}, {"c", "x|y"}}),
            "| setting | value |\n|---|---|\n| a.b | 1 |\n| c | x\\|y |\n");
}

// ---- the progress line
// -------------------------------------------------------------------------------

namespace {
std::string read_all(std::FILE* f) {
  std::fflush(f);
  std::rewind(f);
  std::string s;
  char buf[512];
  while (std::size_t n = std::fread(buf, 1, sizeof buf, f)) s.append(buf, n);
  return s;
}
}  // namespace

TEST(Progress, RateEtaAndTextFromTheRecentWindow) {
  std::FILE* f = std::tmpfile();
  tr::ProgressLine p({.label = "train", .total = 100, .out = f});
  const auto t0 = tr::ProgressLine::Clock::time_point{};
  p.start(0, t0);
  for (int i = 1; i <= 10; ++i) p.update(i, "", t0 + std::chrono::milliseconds(100 * i));
  EXPECT_NEAR(p.rate(), 10.0, 1e-9);
  EXPECT_EQ(p.eta(10), "0:09");
  const std::string line = p.line(10, "loss 1");
  EXPECT_NE(line.find("train 10/100 [##"), std::string::npos) << line;
  EXPECT_NE(line.find(" 10%  10.00 it/s  eta 0:09  loss 1"), std::string::npos) << line;
  // The rate follows the recent steps: 40 slow ones later, it is theirs.
  for (int i = 11; i <= 50; ++i)
    p.update(i, "", t0 + std::chrono::seconds(1) + std::chrono::seconds(i - 10));
  EXPECT_NEAR(p.rate(), 1.0, 1e-9);
  EXPECT_EQ(p.eta(50), "0:50");
  EXPECT_NE(p.line(50).find("1.00 it/s"), std::string::npos);
  for (int i = 51; i <= 52; ++i)
    p.update(i, "", t0 + std::chrono::seconds(41) + std::chrono::seconds(4 * (i - 50)));
  std::fclose(f);
}

TEST(Progress, NotATerminalIsQuietOrOneLinePerN) {
  std::FILE* quiet = std::tmpfile();
  {
    tr::ProgressLine p({.total = 20, .out = quiet});
    EXPECT_FALSE(p.terminal());
    p.start();
    for (int i = 1; i <= 20; ++i) p.update(i, "x");
    p.finish();
  }
  EXPECT_EQ(read_all(quiet), "");
  std::fclose(quiet);
  std::FILE* lines = std::tmpfile();
  {
    tr::ProgressLine p({.total = 23, .lines_every = 10, .out = lines});
    p.start();
    for (int i = 1; i <= 23; ++i) p.update(i, "x");
    p.finish();
  }
  const std::string text = read_all(lines);
  EXPECT_EQ(std::count(text.begin(), text.end(), '\n'), 3) << text;  // 10, 20 and the last, 23
  EXPECT_EQ(text.find('\r'), std::string::npos);
  EXPECT_NE(text.find("train 10/23"), std::string::npos);
  EXPECT_NE(text.find("train 23/23"), std::string::npos);
  std::fclose(lines);
}

TEST(Progress, ATerminalRedrawsInPlace) {
  // A pseudo-terminal: the bar sees a terminal and redraws one line with carriage returns.
  const int master = ::posix_openpt(O_RDWR | O_NOCTTY);
  ASSERT_GE(master, 0);
  ASSERT_EQ(::grantpt(master), 0);
  ASSERT_EQ(::unlockpt(master), 0);
  const int slave = ::open(::ptsname(master), O_RDWR | O_NOCTTY);
  ASSERT_GE(slave, 0);
  std::FILE* tty = ::fdopen(slave, "w");
  {
    tr::ProgressBar bar({.total_steps = 4, .every = 2, .out = tty});
    EXPECT_TRUE(tr::ProgressLine({.out = tty}).terminal());
    struct Fake {
      std::int64_t global_step() const { return 0; }
    } fake;
    bar.on_train_begin(fake);
    for (int i = 1; i <= 4; ++i) {
      tr::StepInfo s;
      s.step = i;
      s.loss = i;
      s.lr = {1e-3};
      bar.on_step_end(fake, s);
    }
    EXPECT_DOUBLE_EQ(bar.running_mean(), 2.5);
    bar.on_train_end(fake);
  }
  std::fflush(tty);
  std::string got;
  char buf[1024];
  for (int tries = 0; tries < 50 && got.find("4/4") == std::string::npos; ++tries) {
    ::fcntl(master, F_SETFL, O_NONBLOCK);
    const ssize_t n = ::read(master, buf, sizeof buf);
    if (n > 0)
      got.append(buf, static_cast<std::size_t>(n));
    else
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  std::fclose(tty);
  ::close(master);
  EXPECT_NE(got.find("\rtrain 2/4"), std::string::npos) << got;
  EXPECT_NE(got.find("\rtrain 4/4"), std::string::npos) << got;
  EXPECT_EQ(got.find("train 1/4"), std::string::npos) << got;  // every 2
  EXPECT_NE(got.find("loss 4.00000 (mean 2.50000)  lr 0.001"), std::string::npos) << got;
}

TEST(Progress, SamplingReportsEveryStepOfEveryChunk) {
  struct Identity {
    at::Tensor operator()(const at::Tensor& x, const at::Tensor&) const {
      return at::zeros_like(x);
    }
  };
  dt::diffusion::NoiseSchedule schedule;
  dt::diffusion::Ddim ddim(schedule, {});
  std::vector<std::pair<std::int64_t, std::int64_t>> seen;
  (void)dt::diffusion::sample(
      ddim, Identity{}, at::randn({5, 1, 2, 2}),
      {.num_inference_steps = 4, .chunk_size = 2, .on_step = [&](std::int64_t d, std::int64_t n) {
         seen.emplace_back(d, n);
       }});
  ASSERT_EQ(seen.size(), 12U);  // 3 chunks × 4 steps
  EXPECT_EQ(seen.front(), std::make_pair(std::int64_t{1}, std::int64_t{12}));
  EXPECT_EQ(seen.back(), std::make_pair(std::int64_t{12}, std::int64_t{12}));
}

// ---- plots
// ---------------------------------------------------------------------------------------------

#if DIFFTRAIN_HAS_PLOT
namespace {
// Dark pixels (text, lines) inside a box of the image.
int dark_pixels(const dt::io::RgbImage& img, const lg::PanelLayout::Box& b) {
  int n = 0;
  for (auto y = static_cast<std::uint32_t>(std::max(0.0, b.y0));
       y < std::min<double>(img.height, b.y1); ++y)
    for (auto x = static_cast<std::uint32_t>(std::max(0.0, b.x0));
         x < std::min<double>(img.width, b.x1); ++x)
      n += img.at(x, y)[0] < 128 ? 1 : 0;
  return n;
}
}  // namespace

TEST(Plot, NiceTicksAndLogTicks) {
  EXPECT_EQ(lg::plot_detail::nice_ticks(0, 1000),
            (std::vector<double>{0, 200, 400, 600, 800, 1000}));
  EXPECT_EQ(lg::plot_detail::nice_ticks(0.013, 0.061, 5),
            (std::vector<double>{0.02, 0.03, 0.04, 0.05, 0.06}));
  const auto lt = lg::plot_detail::log_ticks(std::log10(0.03), std::log10(3.0));  // two decades
  std::vector<double> labelled;
  for (const auto& [v, l] : lt)
    if (l) labelled.push_back(std::round(std::pow(10.0, v) * 1000) / 1000);
  EXPECT_EQ(labelled, (std::vector<double>{0.05, 0.1, 0.2, 0.5, 1, 2}));
  EXPECT_EQ(lg::plot_detail::tick_label(0.0001), "0.0001");
  EXPECT_EQ(lg::running_mean({1, 3, std::nan(""), 5}, 2), (std::vector<double>{1, 2, 3, 5}));
}

TEST(Plot, AxisLabelsTicksTitleAndLegendAreDrawnWhereTheLayoutSays) {
  std::vector<double> x, y;
  for (int i = 1; i <= 500; ++i) x.push_back(i), y.push_back(0.05 + 1.0 / i);
  lg::Axes a{.title = "Training loss", .x_label = "step", .y_label = "loss", .log_y = true};
  a.series.push_back({.label = "per step", .x = x, .y = y});
  lg::PanelLayout lay;
  const dt::io::RgbImage img = lg::plot(a, {.width = 640, .height = 360}, &lay);
  EXPECT_EQ(img.width, 640U);
  EXPECT_EQ(img.height, 360U);
  // Each text box lies in the image, outside the plot area, and has ink in it.
  for (const auto* b : {&lay.title, &lay.x_label, &lay.y_label, &lay.x_ticks, &lay.y_ticks}) {
    EXPECT_GT(b->x1 - b->x0, 5);
    EXPECT_GT(dark_pixels(img, *b), 20);
    EXPECT_GE(b->x0, 0);
    EXPECT_LE(b->x1, 640);
  }
  EXPECT_LT(lay.y_label.x1, lay.plot_area.x0);  // left of the plot
  EXPECT_LT(lay.y_ticks.x1, lay.plot_area.x0);
  EXPECT_GT(lay.x_label.y0, lay.plot_area.y1);  // below it
  EXPECT_GT(lay.x_ticks.y0, lay.plot_area.y1);
  EXPECT_LT(lay.title.y1, lay.plot_area.y0);                                    // above it
  EXPECT_GT(lay.y_label.y1 - lay.y_label.y0, lay.y_label.x1 - lay.y_label.x0);  // written upwards
  // Without labels the same places stay blank: the ink above was the labels.
  lg::Axes bare = a;
  bare.title = bare.x_label = bare.y_label = "";
  lg::PanelLayout bare_lay;
  const dt::io::RgbImage bare_img = lg::plot(bare, {.width = 640, .height = 360}, &bare_lay);
  EXPECT_EQ(dark_pixels(bare_img, {0, 0, bare_lay.y_ticks.x0 - 1, 360}), 0);    // left of the ticks
  EXPECT_EQ(dark_pixels(bare_img, {0, bare_lay.x_ticks.y1 + 1, 640, 360}), 0);  // below them
  EXPECT_EQ(dark_pixels(bare_img, {0, 0, 640, bare_lay.plot_area.y0 - 1}), 0);  // above the plot
  EXPECT_GT(bare_lay.plot_area.x1 - bare_lay.plot_area.x0, lay.plot_area.x1 - lay.plot_area.x0);
  // The series is drawn inside the plot area in its colour.
  int blue = 0;
  for (std::uint32_t yy = 0; yy < img.height; ++yy)
    for (std::uint32_t xx = 0; xx < img.width; ++xx) {
      const auto* p = img.at(xx, yy);
      if (p[2] > 150 && p[0] < 80) {
        ++blue;
        EXPECT_GE(xx + 1, lay.plot_area.x0);
        EXPECT_LE(xx, lay.plot_area.x1 + 1);
      }
    }
  EXPECT_GT(blue, 400);
}

TEST(Plot, GridsEmptyPanelsAndMistakes) {
  lg::Axes empty{.title = "nothing yet", .x_label = "step", .y_label = "loss", .log_y = true};
  empty.series.push_back({.label = "loss", .x = {1, 2}, .y = {0, -1}});  // nothing positive
  std::vector<lg::PanelLayout> lays;
  const auto img =
      lg::draw_figure({empty, empty, empty}, {.width = 900, .height = 600, .columns = 2}, &lays);
  ASSERT_EQ(lays.size(), 3U);
  EXPECT_GT(lays[1].plot_area.x0, 450);  // second column
  EXPECT_GT(lays[2].plot_area.y0, 300);  // second row
  EXPECT_EQ(img.width, 900U);
  lg::Axes bad{.title = "t"};
  bad.series.push_back({.label = "s", .x = {1, 2, 3}, .y = {1, 2}});
  EXPECT_THROW((void)lg::plot(bad), dt::ShapeError);
  EXPECT_THROW((void)lg::draw_figure({}), dt::ConfigError);
  EXPECT_THROW((void)lg::plot(empty, {.width = 10}), dt::ConfigError);
  EXPECT_THROW((void)lg::plot(empty, {.columns = 0}), dt::ConfigError);
}
#endif
