// --token_file's mode check (issue 34): refused when group or others may read
// or write it, whatever the path (symlinks followed), never quoting contents.
#include "server/security/secret_file.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <string>

namespace foreshock::server {
namespace {

class SecretFileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char pattern[] = "/tmp/secret_file_test.XXXXXX";
    ASSERT_NE(mkdtemp(pattern), nullptr);
    dir_ = pattern;
    path_ = dir_ + "/tokens";
    std::ofstream(path_) << "tok-do-not-print * metrics\n";
  }
  void TearDown() override {
    ::unlink((dir_ + "/link").c_str());
    ::unlink(path_.c_str());
    ::rmdir(dir_.c_str());
  }
  absl::Status Check(const std::string& path) {
    return CheckSecretFileMode("--token_file", path, "--allow_insecure_token_file");
  }
  std::string dir_;
  std::string path_;
};

TEST_F(SecretFileTest, OwnerOnlyModesPass) {
  for (mode_t mode : {0600, 0400, 0700, 0200}) {
    ASSERT_EQ(::chmod(path_.c_str(), mode), 0);
    EXPECT_TRUE(Check(path_).ok()) << std::oct << mode << ": " << Check(path_);
  }
}

TEST_F(SecretFileTest, GroupOrOthersAccessIsRefusedWithTheFix) {
  // A group the test process is not in (nogroup), so group read exposes it.
  ASSERT_EQ(::chown(path_.c_str(), static_cast<uid_t>(-1), 65534), 0) << "tests run as root";
  for (mode_t mode : {0644, 0640, 0604, 0660, 0606, 0620, 0602, 0666}) {
    ASSERT_EQ(::chmod(path_.c_str(), mode), 0);
    const absl::Status status = Check(path_);
    ASSERT_FALSE(status.ok()) << std::oct << mode;
    EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition);
    const std::string message(status.message());
    char octal[8];
    std::snprintf(octal, sizeof octal, "%04o", static_cast<unsigned>(mode));
    EXPECT_NE(message.find(std::string("mode ") + octal), std::string::npos) << message;
    EXPECT_NE(message.find("chmod 600"), std::string::npos) << message;
    EXPECT_NE(message.find("--allow_insecure_token_file"), std::string::npos) << message;
    EXPECT_NE(message.find(path_), std::string::npos) << message;
    EXPECT_EQ(message.find("tok-do-not-print"), std::string::npos) << message;
  }
}

// A Kubernetes Secret mounted with the pod's fsGroup: mode 0440, group one
// of the daemon's own. Its group is the daemon's, so it passes; group write
// or others' read never does.
TEST_F(SecretFileTest, GroupReadByTheDaemonsOwnGroupPasses) {
  ASSERT_EQ(::chown(path_.c_str(), static_cast<uid_t>(-1), ::getegid()), 0);
  for (mode_t mode : {0440, 0640}) {
    ASSERT_EQ(::chmod(path_.c_str(), mode), 0);
    EXPECT_TRUE(Check(path_).ok()) << std::oct << mode << ": " << Check(path_);
  }
  for (mode_t mode : {0460, 0660, 0444}) {
    ASSERT_EQ(::chmod(path_.c_str(), mode), 0);
    EXPECT_EQ(Check(path_).code(), absl::StatusCode::kFailedPrecondition) << std::oct << mode;
  }
}

TEST_F(SecretFileTest, SymlinkIsJudgedByItsTarget) {
  // A Kubernetes Secret volume: the path is a 0777 symlink to the real file.
  const std::string link = dir_ + "/link";
  ASSERT_EQ(::symlink(path_.c_str(), link.c_str()), 0);
  ASSERT_EQ(::chmod(path_.c_str(), 0600), 0);
  EXPECT_TRUE(Check(link).ok()) << Check(link);
  ASSERT_EQ(::chmod(path_.c_str(), 0644), 0);
  EXPECT_EQ(Check(link).code(), absl::StatusCode::kFailedPrecondition);
}

TEST_F(SecretFileTest, MissingFileOrDirectory) {
  EXPECT_EQ(Check(dir_ + "/absent").code(), absl::StatusCode::kNotFound);
  ASSERT_EQ(::chmod(dir_.c_str(), 0700), 0);
  EXPECT_EQ(Check(dir_).code(), absl::StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace foreshock::server
