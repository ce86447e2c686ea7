// The recording format (record/recording.h): round trips, a torn tail cut at
// every offset of the last frame, every flipped payload byte, bad headers,
// appending after a crash, and a write error mid-recording.
#include "record/recording.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "store/crc32c.h"

namespace foreshock::record {
namespace {

namespace fs = std::filesystem;

struct Expected {
  std::string payload;
  int64_t recv_us;
};

class RecordingTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("recording_test_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string Path(const std::string& name) const { return (dir_ / name).string(); }

  static std::string ReadAll(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  }
  static void WriteAll(const std::string& path, std::string_view bytes) {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  }

  // Payloads of assorted sizes, including empty and larger than a small buffer.
  static std::vector<Expected> SomeFrames(int n, uint32_t seed = 7) {
    std::mt19937 rng(seed);
    std::vector<Expected> frames;
    const size_t sizes[] = {0, 1, 15, 16, 17, 100, 1000, 5000};
    for (int i = 0; i < n; ++i) {
      std::string payload(sizes[i % 8] + (rng() % 3), '\0');
      for (char& c : payload) c = static_cast<char>(rng());
      frames.push_back({payload, 1714521600000000 + 1234567 * int64_t{i} - (i == 3 ? 5000000 : 0)});
    }
    return frames;
  }

  void WriteFrames(const std::string& path, const std::vector<Expected>& frames,
                   size_t buffer_bytes = 1 << 20) {
    RecordingWriter writer(buffer_bytes);
    std::string error;
    ASSERT_TRUE(writer.Create(path, &error)) << error;
    for (const Expected& f : frames) ASSERT_TRUE(writer.Append(f.payload, f.recv_us, &error)) << error;
    ASSERT_TRUE(writer.Close(&error)) << error;
    EXPECT_EQ(writer.frames(), frames.size());
    EXPECT_EQ(writer.file_bytes(), fs::file_size(path));
  }

  // Reads every frame; returns the final status.
  static ReadStatus ReadFrames(const std::string& path, std::vector<Frame>* out,
                               std::string* error = nullptr) {
    RecordingReader reader;
    if (!reader.Open(path)) {
      if (error) *error = reader.error();
      return ReadStatus::kError;
    }
    Frame frame;
    ReadStatus status;
    while ((status = reader.Next(&frame)) == ReadStatus::kFrame) out->push_back(frame);
    if (error) *error = reader.error();
    EXPECT_EQ(reader.Next(&frame), status) << "the final status must be sticky";
    return status;
  }

  fs::path dir_;
};

TEST_F(RecordingTest, HeaderLayout) {
  const std::string path = Path("empty.fsrec");
  WriteFrames(path, {});
  const std::string bytes = ReadAll(path);
  ASSERT_EQ(bytes.size(), kFileHeaderBytes);
  EXPECT_EQ(bytes.substr(0, 8), "FSHKREC1");
  EXPECT_EQ(bytes.substr(8, 4), std::string("\x01\0\0\0", 4));
  EXPECT_EQ(bytes.substr(12, 4), std::string(4, '\0'));
  std::vector<Frame> frames;
  EXPECT_EQ(ReadFrames(path, &frames), ReadStatus::kEnd);
  EXPECT_TRUE(frames.empty());
}

TEST_F(RecordingTest, FrameLayout) {
  const std::string path = Path("one.fsrec");
  WriteFrames(path, {{"hello", -2}});
  const std::string bytes = ReadAll(path).substr(kFileHeaderBytes);
  ASSERT_EQ(bytes.size(), kFrameHeaderBytes + 5);
  EXPECT_EQ(bytes.substr(0, 4), std::string("\x05\0\0\0", 4));
  const uint32_t crc = store::Crc32c(std::string_view("hello"));
  const std::string le_crc{static_cast<char>(crc), static_cast<char>(crc >> 8),
                           static_cast<char>(crc >> 16), static_cast<char>(crc >> 24)};
  EXPECT_EQ(bytes.substr(4, 4), le_crc);
  EXPECT_EQ(bytes.substr(8, 8), std::string(8, '\xff').replace(0, 1, "\xfe"));
  EXPECT_EQ(bytes.substr(16), "hello");
  EXPECT_EQ(bytes.substr(0, 16), FrameHeader("hello", -2));
}

TEST_F(RecordingTest, RoundTripWithEveryBufferSize) {
  const std::vector<Expected> expected = SomeFrames(40);
  for (size_t buffer : {size_t{0}, size_t{16}, size_t{100}, size_t{4096}, size_t{1} << 20}) {
    SCOPED_TRACE(buffer);
    const std::string path = Path("rt" + std::to_string(buffer) + ".fsrec");
    WriteFrames(path, expected, buffer);
    std::vector<Frame> frames;
    std::string error;
    ASSERT_EQ(ReadFrames(path, &frames, &error), ReadStatus::kEnd) << error;
    ASSERT_EQ(frames.size(), expected.size());
    uint64_t offset = kFileHeaderBytes;
    for (size_t i = 0; i < frames.size(); ++i) {
      EXPECT_EQ(frames[i].payload, expected[i].payload) << i;
      EXPECT_EQ(frames[i].recv_unix_us, expected[i].recv_us) << i;
      EXPECT_EQ(frames[i].index, i);
      EXPECT_EQ(frames[i].offset, offset);
      offset += kFrameHeaderBytes + expected[i].payload.size();
    }
  }
}

TEST_F(RecordingTest, AppendFromPartsEqualsAppendWhole) {
  const std::string a = Path("parts.fsrec"), b = Path("whole.fsrec");
  std::string error;
  {
    RecordingWriter writer(64);
    ASSERT_TRUE(writer.Create(a, &error)) << error;
    ASSERT_TRUE(writer.Append({"ab", "", "cdefgh"}, 5, &error)) << error;
    const std::string big(300, 'x');
    ASSERT_TRUE(writer.Append({big, "y", big}, 6, &error)) << error;  // straight through
    ASSERT_TRUE(writer.Close(&error)) << error;
  }
  WriteFrames(b, {{"abcdefgh", 5}, {std::string(300, 'x') + "y" + std::string(300, 'x'), 6}});
  EXPECT_EQ(ReadAll(a), ReadAll(b));
}

TEST_F(RecordingTest, FlushMakesFramesVisibleToAReader) {
  const std::string path = Path("live.fsrec");
  RecordingWriter writer;
  std::string error;
  ASSERT_TRUE(writer.Create(path, &error)) << error;
  ASSERT_TRUE(writer.Append("one", 1, &error));
  std::vector<Frame> frames;
  EXPECT_EQ(ReadFrames(path, &frames), ReadStatus::kEnd);
  EXPECT_TRUE(frames.empty()) << "buffered, not yet written";
  ASSERT_TRUE(writer.Flush(&error)) << error;
  EXPECT_EQ(ReadFrames(path, &frames), ReadStatus::kEnd);
  ASSERT_EQ(frames.size(), 1u);
  EXPECT_EQ(frames[0].payload, "one");
  ASSERT_TRUE(writer.Sync(&error)) << error;
  ASSERT_TRUE(writer.Close(&error)) << error;
  ASSERT_TRUE(writer.Close(&error)) << "closing twice is harmless";
}

TEST_F(RecordingTest, TornTailAtEveryOffsetOfTheLastFrame) {
  const std::vector<Expected> expected = SomeFrames(7);  // the last payload is 1000+ bytes
  const std::string path = Path("full.fsrec");
  WriteFrames(path, expected);
  const std::string bytes = ReadAll(path);
  const size_t last_start = bytes.size() - kFrameHeaderBytes - expected.back().payload.size();
  const std::string cut = Path("cut.fsrec");
  for (size_t size = last_start; size < bytes.size(); ++size) {
    SCOPED_TRACE(size);
    WriteAll(cut, std::string_view(bytes).substr(0, size));
    std::vector<Frame> frames;
    RecordingReader reader;
    ASSERT_TRUE(reader.Open(cut)) << reader.error();
    Frame frame;
    ReadStatus status;
    while ((status = reader.Next(&frame)) == ReadStatus::kFrame) frames.push_back(frame);
    ASSERT_EQ(frames.size(), expected.size() - 1);
    for (size_t i = 0; i < frames.size(); ++i) EXPECT_EQ(frames[i].payload, expected[i].payload);
    EXPECT_EQ(reader.valid_bytes(), last_start);
    if (size == last_start) {
      EXPECT_EQ(status, ReadStatus::kEnd) << "a cut at a frame boundary is a clean end";
      EXPECT_TRUE(reader.error().empty());
    } else {
      EXPECT_EQ(status, ReadStatus::kTruncated) << reader.error();
      EXPECT_NE(reader.error().find("truncated tail"), std::string::npos) << reader.error();
      EXPECT_NE(reader.error().find("frame 6 at offset " + std::to_string(last_start)),
                std::string::npos)
          << reader.error();
    }
  }
}

TEST_F(RecordingTest, OpenForAppendCutsATornTail) {
  const std::vector<Expected> expected = SomeFrames(5);
  const std::string path = Path("torn.fsrec");
  WriteFrames(path, expected);
  const std::string bytes = ReadAll(path);
  WriteAll(path, std::string_view(bytes).substr(0, bytes.size() - 3));

  RecordingWriter writer;
  std::string error;
  ASSERT_TRUE(writer.Open(path, &error)) << error;
  ASSERT_TRUE(writer.Append("after the crash", 99, &error)) << error;
  ASSERT_TRUE(writer.Close(&error)) << error;

  std::vector<Frame> frames;
  ASSERT_EQ(ReadFrames(path, &frames, &error), ReadStatus::kEnd) << error;
  ASSERT_EQ(frames.size(), expected.size());
  for (size_t i = 0; i + 1 < expected.size(); ++i) EXPECT_EQ(frames[i].payload, expected[i].payload);
  EXPECT_EQ(frames.back().payload, "after the crash");
  EXPECT_EQ(frames.back().recv_unix_us, 99);
}

TEST_F(RecordingTest, OpenCreatesAMissingFileAndRestartsATornHeader) {
  std::string error;
  const std::string fresh = Path("fresh.fsrec");
  {
    RecordingWriter writer;
    ASSERT_TRUE(writer.Open(fresh, &error)) << error;
    ASSERT_TRUE(writer.Append("x", 1, &error)) << error;
  }
  std::vector<Frame> frames;
  ASSERT_EQ(ReadFrames(fresh, &frames), ReadStatus::kEnd);
  ASSERT_EQ(frames.size(), 1u);

  const std::string torn = Path("tornheader.fsrec");
  WriteAll(torn, "FSHKR");
  {
    RecordingWriter writer;
    ASSERT_TRUE(writer.Open(torn, &error)) << error;
    ASSERT_TRUE(writer.Append("y", 2, &error)) << error;
  }
  frames.clear();
  ASSERT_EQ(ReadFrames(torn, &frames, &error), ReadStatus::kEnd) << error;
  ASSERT_EQ(frames.size(), 1u);
  EXPECT_EQ(frames[0].payload, "y");

  const std::string other = Path("other.txt");
  WriteAll(other, "hi");
  RecordingWriter writer;
  EXPECT_FALSE(writer.Open(other, &error));
  EXPECT_NE(error.find("not a Foreshock recording"), std::string::npos) << error;
}

TEST_F(RecordingTest, CreateRefusesAnExistingFile) {
  const std::string path = Path("exists.fsrec");
  WriteFrames(path, {{"a", 1}});
  RecordingWriter writer;
  std::string error;
  EXPECT_FALSE(writer.Create(path, &error));
  EXPECT_NE(error.find("File exists"), std::string::npos) << error;
  EXPECT_FALSE(writer.is_open());
}

TEST_F(RecordingTest, EveryFlippedPayloadByteIsDetected) {
  const std::vector<Expected> expected = SomeFrames(4);
  const std::string path = Path("good.fsrec");
  WriteFrames(path, expected);
  const std::string bytes = ReadAll(path);
  const std::string bad = Path("bad.fsrec");
  size_t offset = kFileHeaderBytes;
  for (size_t f = 0; f < expected.size(); ++f) {
    const size_t payload_at = offset + kFrameHeaderBytes;
    for (size_t i = payload_at; i < payload_at + expected[f].payload.size(); ++i) {
      std::string flipped = bytes;
      flipped[i] ^= 0x10;
      WriteAll(bad, flipped);
      std::vector<Frame> frames;
      std::string error;
      ASSERT_EQ(ReadFrames(bad, &frames, &error), ReadStatus::kError) << "byte " << i;
      EXPECT_EQ(frames.size(), f);
      EXPECT_NE(error.find("CRC-32C"), std::string::npos) << error;
      EXPECT_NE(error.find("frame " + std::to_string(f) + " at offset " + std::to_string(offset)),
                std::string::npos)
          << error;
    }
    offset = payload_at + expected[f].payload.size();
  }
}

TEST_F(RecordingTest, FlippedHeaderBytesNeverCrashTheReader) {
  // Length and CRC bytes are caught (CRC mismatch, over-limit length, or a
  // length running past the end); the receive time is not checksummed.
  const std::vector<Expected> expected = SomeFrames(4);
  const std::string path = Path("good.fsrec");
  WriteFrames(path, expected);
  const std::string bytes = ReadAll(path);
  const std::string bad = Path("bad.fsrec");
  const size_t second = kFileHeaderBytes + kFrameHeaderBytes + expected[0].payload.size();
  for (size_t i = second; i < second + 8; ++i) {
    for (int bit = 0; bit < 8; ++bit) {
      std::string flipped = bytes;
      flipped[i] ^= static_cast<char>(1 << bit);
      WriteAll(bad, flipped);
      std::vector<Frame> frames;
      const ReadStatus status = ReadFrames(bad, &frames);
      EXPECT_NE(status, ReadStatus::kEnd) << "byte " << i << " bit " << bit;
      EXPECT_EQ(frames.size(), 1u);
    }
  }
}

TEST_F(RecordingTest, BadMagicVersionAndShortFiles) {
  std::string error;
  std::vector<Frame> frames;
  const std::string path = Path("x.fsrec");

  WriteAll(path, std::string("FSHKSEG1") + std::string(8, '\0'));
  EXPECT_EQ(ReadFrames(path, &frames, &error), ReadStatus::kError);
  EXPECT_NE(error.find("not a Foreshock recording"), std::string::npos) << error;
  EXPECT_NE(error.find(path), std::string::npos) << "the message names the file: " << error;

  std::string v2 = FileHeader();
  v2[8] = 2;
  WriteAll(path, v2);
  EXPECT_EQ(ReadFrames(path, &frames, &error), ReadStatus::kError);
  EXPECT_NE(error.find("unsupported recording version 2"), std::string::npos) << error;

  WriteAll(path, "");
  EXPECT_EQ(ReadFrames(path, &frames, &error), ReadStatus::kError);
  EXPECT_NE(error.find("not a Foreshock recording"), std::string::npos) << error;

  WriteAll(path, FileHeader().substr(0, 12));
  EXPECT_EQ(ReadFrames(path, &frames, &error), ReadStatus::kError);
  EXPECT_NE(error.find("header is cut short"), std::string::npos) << error;

  EXPECT_EQ(ReadFrames(Path("missing.fsrec"), &frames, &error), ReadStatus::kError);
  EXPECT_NE(error.find("No such file"), std::string::npos) << error;

  // A length over the limit is corruption, not a huge allocation.
  std::string huge = FileHeader() + std::string("\xff\xff\xff\xff", 4) + std::string(12, '\0');
  WriteAll(path, huge);
  EXPECT_EQ(ReadFrames(path, &frames, &error), ReadStatus::kError);
  EXPECT_NE(error.find("over the limit"), std::string::npos) << error;
  EXPECT_TRUE(frames.empty());
}

TEST_F(RecordingTest, AWriteErrorIsStickyAndLeavesAReadablePrefix) {
  // In a child: a file size limit makes write(2) fail with EFBIG part way.
  const std::string path = Path("limited.fsrec");
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    ::signal(SIGXFSZ, SIG_IGN);
    struct rlimit limit = {10000, 10000};
    ::setrlimit(RLIMIT_FSIZE, &limit);
    RecordingWriter writer(256);
    std::string error;
    if (!writer.Create(path, &error)) ::_exit(10);
    const std::string payload(300, 'p');  // over the buffer: written straight through
    int appended = 0;
    while (writer.Append(payload, appended, &error)) ++appended;
    if (error.find("cannot write recording") == std::string::npos) ::_exit(11);
    std::string again;
    if (writer.Append("x", 0, &again) || again != error) ::_exit(12);
    if (writer.Flush(&again) || writer.Close(&again)) ::_exit(13);
    ::_exit(appended > 0 && appended < 40 ? 0 : 14);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status));
  ASSERT_EQ(WEXITSTATUS(status), 0);
  std::vector<Frame> frames;
  std::string error;
  const ReadStatus read = ReadFrames(path, &frames, &error);
  EXPECT_TRUE(read == ReadStatus::kTruncated || read == ReadStatus::kEnd) << error;
  EXPECT_GT(frames.size(), 0u);
  for (const Frame& f : frames) EXPECT_EQ(f.payload, std::string(300, 'p'));
}

TEST(RecordingNames, CompactUtcTimeAndSanitize) {
  EXPECT_EQ(CompactUtcTime(1714521600000000), "20240501T000000");
  EXPECT_EQ(CompactUtcTime(1714563845999999), "20240501T114405");
  EXPECT_EQ(SanitizeForFileName("run-1.a_B"), "run-1.a_B");
  EXPECT_EQ(SanitizeForFileName("../etc/passwd"), "_._etc_passwd");
  EXPECT_EQ(SanitizeForFileName("a b/c\\d:é"), "a_b_c_d___");
  EXPECT_EQ(SanitizeForFileName(""), "unknown");
  EXPECT_EQ(SanitizeForFileName(std::string(100, 'r')).size(), 64u);
}

TEST(RecordingNames, ReadStatusNames) {
  EXPECT_STREQ(ReadStatusName(ReadStatus::kFrame), "frame");
  EXPECT_STREQ(ReadStatusName(ReadStatus::kEnd), "end");
  EXPECT_STREQ(ReadStatusName(ReadStatus::kTruncated), "truncated");
  EXPECT_STREQ(ReadStatusName(ReadStatus::kError), "error");
}

}  // namespace
}  // namespace foreshock::record
