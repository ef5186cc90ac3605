// The node's image cache and the one-pass image write (image_cache.hpp), against real files, a
// real HTTP server (tests/image_server.py: byte ranges, a connection it drops on purpose, a slow
// download) and qemu-img. SKIPs without python3 or qemu-img.
#include <fcntl.h>
#include <sys/stat.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <random>
#include <thread>

#include <gtest/gtest.h>

#include "gpuaas/node_agent/host/host.hpp"
#include "runtime/image_cache.hpp"
#include "test_env.hpp"
#include "test_files.hpp"

namespace gpuaas::node_agent {
namespace {

namespace fs = std::filesystem;
using std::chrono::milliseconds;

std::string Random(size_t n, unsigned seed) {
  std::mt19937 g(seed);
  std::string s(n, '\0');
  for (auto& c : s) c = static_cast<char>(g() & 0xff);
  return s;
}

struct Seen {
  std::vector<std::string> details;
  std::vector<ByteProgress> bytes;
  std::mutex mu;
  ProgressFn Fn() {
    return [this](const std::string&, const std::string& d, int, const ByteProgress* b) {
      std::lock_guard l(mu);
      details.push_back(d);
      if (b) bytes.push_back(*b);
    };
  }
  bool Said(const std::string& part) {
    std::lock_guard l(mu);
    for (const auto& d : details) {
      if (d.find(part) != std::string::npos) return true;
    }
    return false;
  }
};

class ImageCacheTest : public ::testing::Test {
 protected:
  void SetUp() override {
    for (const char* t : {"python3", "qemu-img"}) {
      if (!Tool(t)) GTEST_SKIP() << t << " is not installed";
    }
    work_ = gpuaas::testing::MakeTempDir("gpuaas-image-cache");
    fs::create_directories(work_ + "/srv");
    opts_.dir = work_ + "/cache";
    opts_.retry_delay = milliseconds(10);
    opts_.timeout = std::chrono::seconds(60);
  }
  void TearDown() override {
    server_.Stop(std::chrono::seconds(2));
    fs::remove_all(work_);
  }
  // The HTTP server over work_/srv with `flags`; its base URL.
  std::string Serve(std::vector<std::string> flags = {}) {
    const std::string script = std::string(GPUAAS_NODE_AGENT_TESTS) + "/image_server.py";
    std::vector<std::string> argv = {*Tool("python3"), script,  work_ + "/srv",     "--port-file",
                                     work_ + "/port",  "--log", work_ + "/requests"};
    argv.insert(argv.end(), flags.begin(), flags.end());
    server_.Spawn(argv, work_ + "/server.log");
    EXPECT_TRUE(gpuaas::testing::WaitFor([&] { return fs::exists(work_ + "/port"); }))
        << ReadAll(work_ + "/server.log");
    return "http://127.0.0.1:" + ReadAll(work_ + "/port");
  }
  std::vector<std::string> Requests() {
    std::vector<std::string> out;
    std::ifstream f(work_ + "/requests");
    for (std::string l; std::getline(f, l);) out.push_back(l);
    return out;
  }
  v1::ImageRef Ref(const std::string& url, const std::string& digest) {
    v1::ImageRef r;
    r.set_name("test-image");
    r.set_url(url);
    r.set_sha256(digest);
    return r;
  }
  std::string Digest(const std::string& path) { return Sha256File(path).value(); }

  std::string work_;
  ImageCacheOptions opts_;
  gpuaas::testing::Process server_;
};

TEST_F(ImageCacheTest, ABrokenDownloadResumesWhereItStoppedAndReportsBytes) {
  const std::string body = Random(3 << 20, 1);
  WriteAll(work_ + "/srv/img", body);
  const std::string url = Serve({"--cut", "img:1000000"});
  ImageCache cache(opts_);
  Seen seen;
  auto c = cache.Ensure(Ref(url + "/img", Digest(work_ + "/srv/img")), seen.Fn());
  ASSERT_TRUE(c.ok()) << c.error().ToString();
  EXPECT_EQ(c->format, "raw");
  EXPECT_EQ(c->size, body.size());
  EXPECT_EQ(ReadAll(c->path), body);
  auto reqs = Requests();
  ASSERT_EQ(reqs.size(), 2u);
  EXPECT_EQ(reqs[0], "GET /img - 200");
  EXPECT_EQ(reqs[1], "GET /img bytes=1000000- 206");  // only the rest came again
  EXPECT_TRUE(seen.Said("attempt 2 of 5 resumes at"));
  ASSERT_FALSE(seen.bytes.empty());
  EXPECT_EQ(seen.bytes.back().phase, "fetch");
  EXPECT_EQ(seen.bytes.back().done, body.size());
  EXPECT_EQ(seen.bytes.back().total, body.size());
  EXPECT_GT(seen.bytes.back().bytes_per_second, 0u);

  // Cached: the next provision fetches nothing.
  Seen again;
  ASSERT_TRUE(cache.Ensure(Ref(url + "/img", Digest(work_ + "/srv/img")), again.Fn()).ok());
  EXPECT_EQ(Requests().size(), 2u);
  EXPECT_TRUE(again.Said("in the node's cache"));
}

TEST_F(ImageCacheTest, AServerWithoutRangesIsFetchedAgainFromTheStart) {
  const std::string body = Random(1 << 20, 2);
  WriteAll(work_ + "/srv/img", body);
  const std::string url = Serve({"--cut", "img:300000", "--no-range"});
  ImageCache cache(opts_);
  Seen seen;
  auto c = cache.Ensure(Ref(url + "/img", Digest(work_ + "/srv/img")), seen.Fn());
  ASSERT_TRUE(c.ok()) << c.error().ToString();
  EXPECT_EQ(ReadAll(c->path), body);
  auto reqs = Requests();
  ASSERT_EQ(reqs.size(), 3u);  // cut, the refused resume (200, not 206), from the start
  EXPECT_EQ(reqs[1], "GET /img bytes=300000- 200");
  EXPECT_EQ(reqs[2], "GET /img - 200");
  EXPECT_TRUE(seen.Said("cannot resume"));
}

TEST_F(ImageCacheTest, ConcurrentProvisionsShareOneDownload) {
  const std::string body = Random(1 << 20, 3);
  WriteAll(work_ + "/srv/img", body);
  const std::string url = Serve({"--chunk-delay-ms", "30"});  // ~0.5 s
  ImageCache cache(opts_);
  const auto ref = Ref(url + "/img", Digest(work_ + "/srv/img"));
  Seen a, b;
  Result<CachedImage> ra = Error::Internal("x", "not run"), rb = Error::Internal("x", "not run");
  std::thread ta([&] { ra = cache.Ensure(ref, a.Fn()); });
  ASSERT_TRUE(gpuaas::testing::WaitFor([&] { return !Requests().empty(); }));
  std::thread tb([&] { rb = cache.Ensure(ref, b.Fn()); });
  ta.join();
  tb.join();
  ASSERT_TRUE(ra.ok()) << ra.error().ToString();
  ASSERT_TRUE(rb.ok()) << rb.error().ToString();
  EXPECT_EQ(ra->path, rb->path);
  EXPECT_EQ(Requests().size(), 1u);
  EXPECT_TRUE(b.Said("another provision on this node is fetching it"));
}

TEST_F(ImageCacheTest, MissingWrongAndUnreachableImages) {
  WriteAll(work_ + "/srv/img", Random(100000, 4));
  const std::string url = Serve();
  opts_.fetch_attempts = 2;
  ImageCache cache(opts_);
  auto missing = cache.Ensure(Ref(url + "/nope", std::string(64, 'a')), {});
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.error().reason, "image_not_found");
  EXPECT_FALSE(missing.error().retryable);
  EXPECT_EQ(missing.error().details.at("http_status"), "404");

  auto wrong = cache.Ensure(Ref(url + "/img", std::string(64, 'b')), {});
  ASSERT_FALSE(wrong.ok());
  EXPECT_EQ(wrong.error().reason, "image_digest_mismatch");
  EXPECT_EQ(wrong.error().details.at("actual_sha256"), Digest(work_ + "/srv/img"));
  EXPECT_FALSE(fs::exists(opts_.dir + "/" + std::string(64, 'b') + ".img"));
  EXPECT_FALSE(fs::exists(opts_.dir + "/" + std::string(64, 'b') + ".partial"));

  auto file = cache.Ensure(Ref("file://" + work_ + "/srv/none", std::string(64, 'c')), {});
  ASSERT_FALSE(file.ok());
  EXPECT_EQ(file.error().reason, "image_not_found");

  auto ftp = cache.Ensure(Ref("ftp://127.0.0.1/img", std::string(64, 'd')), {});
  ASSERT_FALSE(ftp.ok());
  EXPECT_EQ(ftp.error().reason, "image_url_unsupported");

  server_.Stop(std::chrono::seconds(2));  // nothing listens on the port any more
  Seen seen;
  auto down = cache.Ensure(Ref(url + "/img", std::string(64, 'e')), seen.Fn());
  ASSERT_FALSE(down.ok());
  EXPECT_EQ(down.error().reason, "image_fetch_failed");
  EXPECT_TRUE(down.error().retryable);  // the task may be retried: nothing is wrong with it
  EXPECT_TRUE(seen.Said("attempt 2 of 2"));
}

TEST_F(ImageCacheTest, Qcow2IsConvertedOnceIntoAVerifiedRawCopy) {
  std::string raw = Random(2 << 20, 5);
  raw.append(std::string(1 << 20, '\0'));
  WriteAll(work_ + "/raw", raw);
  auto q = RunTool({*Tool("qemu-img"), "convert", "-f", "raw", "-O", "qcow2", work_ + "/raw",
                    work_ + "/srv/img.qcow2"},
                   std::chrono::seconds(60));
  ASSERT_TRUE(q.ok() && q->exit_code == 0);
  const std::string digest = Digest(work_ + "/srv/img.qcow2");
  ImageCache cache(opts_);
  Seen seen;
  auto c = cache.Ensure(Ref("file://" + work_ + "/srv/img.qcow2", digest), seen.Fn());
  ASSERT_TRUE(c.ok()) << c.error().ToString();
  EXPECT_EQ(c->format, "qcow2");
  EXPECT_EQ(c->path, opts_.dir + "/" + digest + ".raw");
  EXPECT_EQ(c->size, raw.size());
  EXPECT_EQ(c->sha256, Digest(work_ + "/raw"));
  EXPECT_FALSE(fs::exists(opts_.dir + "/" + digest + ".img"));  // only the raw copy is kept
  EXPECT_TRUE(seen.Said("converting qcow2 to a raw copy"));

  const std::string disk = work_ + "/disk";
  WriteAll(disk, std::string(1 << 20, '\x55'));  // a fixture disk smaller than the image grows
  auto w = WriteImage(*c, disk, false, fs::file_size(disk), std::chrono::seconds(60), {});
  ASSERT_TRUE(w.ok()) << w.error().ToString();
  EXPECT_EQ(ReadAll(disk), raw);

  Seen hit;
  ASSERT_TRUE(cache.Ensure(Ref("file://" + work_ + "/srv/img.qcow2", digest), hit.Fn()).ok());
  EXPECT_TRUE(hit.Said("in the node's cache"));
  EXPECT_FALSE(hit.Said("converting"));

  // The raw copy replaced behind the cache's back (another inode): converted again.
  const std::string copy = c->path + ".copy";
  fs::copy_file(c->path, copy);
  fs::rename(copy, c->path);
  Seen redo;
  ASSERT_TRUE(cache.Ensure(Ref("file://" + work_ + "/srv/img.qcow2", digest), redo.Fn()).ok());
  EXPECT_TRUE(redo.Said("converting"));
}

TEST_F(ImageCacheTest, TheWriteVerifiesTheDigestAndLeavesTheHeadZeroOnAMismatch) {
  const std::string body = Random((9 << 20) + 100, 6);  // 3 chunks, a partial last sector
  WriteAll(work_ + "/srv/img", body);
  ImageCache cache(opts_);
  auto c = cache.Ensure(Ref("file://" + work_ + "/srv/img", Digest(work_ + "/srv/img")), {});
  ASSERT_TRUE(c.ok()) << c.error().ToString();

  const std::string disk = work_ + "/disk";
  WriteAll(disk, std::string(10 << 20, '\xab'));
  Seen seen;
  auto w = WriteImage(*c, disk, false, 10 << 20, std::chrono::seconds(60), seen.Fn());
  ASSERT_TRUE(w.ok()) << w.error().ToString();
  EXPECT_EQ(ReadAll(disk).substr(0, body.size()), body);
  ASSERT_FALSE(seen.bytes.empty());
  EXPECT_EQ(seen.bytes.back().phase, "write");
  EXPECT_EQ(seen.bytes.back().done, body.size());
  EXPECT_GT(seen.bytes.back().bytes_per_second, 0u);

  // One byte of the cached copy rots; its file identity (inode, size, mtime) stays the same.
  struct stat st {};
  ASSERT_EQ(::stat(c->path.c_str(), &st), 0);
  {
    std::fstream f(c->path, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(6 << 20);
    f.put(static_cast<char>(body[6 << 20] ^ 1));
  }
  const timespec times[2] = {st.st_atim, st.st_mtim};
  ASSERT_EQ(::utimensat(AT_FDCWD, c->path.c_str(), times, 0), 0);
  auto same = cache.Ensure(Ref("file://" + work_ + "/srv/img", c->sha256), {});
  ASSERT_TRUE(same.ok());  // the record still matches: only reading it all can tell

  WriteAll(disk, std::string(10 << 20, '\xab'));
  auto bad = WriteImage(*same, disk, false, 10 << 20, std::chrono::seconds(60), {});
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.error().reason, "image_digest_mismatch");
  EXPECT_EQ(bad.error().details.at("expected_sha256"), c->sha256);
  const std::string after = ReadAll(disk);
  EXPECT_EQ(after.substr(0, 4 << 20), std::string(4 << 20, '\0'));  // no boot sector
  EXPECT_EQ(after.substr(8 << 20, 1 << 20), body.substr(8 << 20, 1 << 20));

  cache.Evict(c->sha256);
  EXPECT_FALSE(fs::exists(c->path));
  auto fresh = cache.Ensure(Ref("file://" + work_ + "/srv/img", c->sha256), {});
  ASSERT_TRUE(fresh.ok());
  ASSERT_TRUE(WriteImage(*fresh, disk, false, 10 << 20, std::chrono::seconds(60), {}).ok());
  EXPECT_EQ(ReadAll(disk).substr(0, body.size()), body);
}

}  // namespace
}  // namespace gpuaas::node_agent
