#include "runtime/image_cache.hpp"

#include <curl/curl.h>
#include <fcntl.h>
#include <linux/fs.h>
#include <openssl/evp.h>
#include <sys/file.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "gpuaas/node_agent/host/host.hpp"
#include "gpuaas/node_agent/node_agent_reasons.hpp"
#include "host/tool_run.hpp"

namespace gpuaas::node_agent {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

constexpr const char* kStage = "image";
constexpr size_t kChunk = size_t{4} << 20;  // one hash update, one write
constexpr size_t kAlign = 4096;

std::string Errno(int e) { return std::strerror(e); }

class Fd {
 public:
  explicit Fd(int fd = -1) : fd_(fd) {}
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }
  bool ok() const { return fd_ >= 0; }

 private:
  int fd_;
};

struct AlignedFree {
  void operator()(char* p) const { std::free(p); }
};
using Buffer = std::unique_ptr<char, AlignedFree>;
Buffer NewBuffer(size_t n) { return Buffer(static_cast<char*>(std::aligned_alloc(kAlign, n))); }

class Sha256 {
 public:
  Sha256() : ctx_(EVP_MD_CTX_new()) { EVP_DigestInit_ex(ctx_, EVP_sha256(), nullptr); }
  ~Sha256() { EVP_MD_CTX_free(ctx_); }
  Sha256(const Sha256&) = delete;
  Sha256& operator=(const Sha256&) = delete;
  void Reset() { EVP_DigestInit_ex(ctx_, EVP_sha256(), nullptr); }
  void Update(const void* p, size_t n) { EVP_DigestUpdate(ctx_, p, n); }
  std::string Hex() {
    unsigned char md[EVP_MAX_MD_SIZE];
    unsigned int len = 0;
    EVP_DigestFinal_ex(ctx_, md, &len);
    std::string out;
    out.reserve(static_cast<size_t>(len) * 2);
    for (unsigned i = 0; i < len; ++i) out += fmt::format("{:02x}", md[i]);
    return out;
  }

 private:
  EVP_MD_CTX* ctx_;
};

// Hashes [0, n) of fd into h; false on a read error or a short file.
bool HashPrefix(int fd, uint64_t n, Sha256& h) {
  auto buf = NewBuffer(kChunk);
  uint64_t off = 0;
  while (off < n) {
    const size_t want = static_cast<size_t>(std::min<uint64_t>(kChunk, n - off));
    const ssize_t r = ::pread(fd, buf.get(), want, static_cast<off_t>(off));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    h.Update(buf.get(), static_cast<size_t>(r));
    off += static_cast<uint64_t>(r);
  }
  return true;
}

std::string Human(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (bytes >= 1024 && u < 4) {
    bytes /= 1024;
    ++u;
  }
  return fmt::format("{:.1f} {}", bytes, units[u]);
}

ByteProgress Bytes(const char* phase, uint64_t done, uint64_t total, Clock::time_point t0) {
  const double s = std::chrono::duration<double>(Clock::now() - t0).count();
  return {phase, done, total, s > 0 ? static_cast<uint64_t>(static_cast<double>(done) / s) : 0};
}

std::string Rate(const ByteProgress& b) {
  return fmt::format("{} of {} at {}/s", Human(static_cast<double>(b.done)),
                     b.total ? Human(static_cast<double>(b.total)) : std::string("?"),
                     Human(static_cast<double>(b.bytes_per_second)));
}

Error Fail(Code code, Reason reason, std::string message,
           std::map<std::string, std::string> det = {}) {
  return StageError(code, reason, std::move(message), kStage, std::move(det));
}

// ---------------------------------------------------------------------------------------------
// Fetch.

struct FetchState {
  int fd = -1;
  uint64_t offset = 0;  // bytes in the partial file
  Sha256* hash = nullptr;
  bool write_failed = false;
  int write_errno = 0;
  Clock::time_point t0;
  Clock::time_point deadline;
  Clock::time_point last_report;
  uint64_t start_offset = 0;
  const ProgressFn* progress = nullptr;
  std::string name;
};

size_t OnData(char* data, size_t size, size_t nmemb, void* user) {
  auto* st = static_cast<FetchState*>(user);
  const size_t n = size * nmemb;
  size_t done = 0;
  while (done < n) {
    const ssize_t w =
        ::pwrite(st->fd, data + done, n - done, static_cast<off_t>(st->offset + done));
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) {
      st->write_failed = true;
      st->write_errno = errno;
      return 0;  // libcurl: CURLE_WRITE_ERROR
    }
    done += static_cast<size_t>(w);
  }
  st->hash->Update(data, n);
  st->offset += n;
  return n;
}

int OnProgress(void* user, curl_off_t dltotal, curl_off_t dlnow, curl_off_t, curl_off_t) {
  auto* st = static_cast<FetchState*>(user);
  const auto now = Clock::now();
  if (now >= st->deadline) return 1;  // CURLE_ABORTED_BY_CALLBACK
  if (now - st->last_report >= std::chrono::seconds(1) && dlnow > 0) {
    st->last_report = now;
    const uint64_t total = dltotal > 0 ? st->start_offset + static_cast<uint64_t>(dltotal) : 0;
    ByteProgress b = Bytes("fetch", st->offset, total, st->t0);
    // The rate counts this attempt's bytes only (a resumed prefix did not move now).
    const double s = std::chrono::duration<double>(now - st->t0).count();
    b.bytes_per_second =
        s > 0 ? static_cast<uint64_t>(static_cast<double>(st->offset - st->start_offset) / s) : 0;
    const int pct = total ? static_cast<int>(45 * st->offset / total) : 0;
    (*st->progress)(kStage, fmt::format("fetching {}: {}", st->name, Rate(b)), pct, b);
  }
  return 0;
}

bool Transient(CURLcode c, long http) {
  switch (c) {
    case CURLE_COULDNT_CONNECT:
    case CURLE_COULDNT_RESOLVE_HOST:
    case CURLE_COULDNT_RESOLVE_PROXY:
    case CURLE_OPERATION_TIMEDOUT:
    case CURLE_RECV_ERROR:
    case CURLE_SEND_ERROR:
    case CURLE_PARTIAL_FILE:
    case CURLE_GOT_NOTHING:
    case CURLE_SSL_CONNECT_ERROR:
    case CURLE_HTTP2:
    case CURLE_HTTP2_STREAM:
      return true;
    case CURLE_HTTP_RETURNED_ERROR:
      return http >= 500 || http == 408 || http == 429;
    default:
      return false;
  }
}

void CurlInitOnce() {
  static std::once_flag once;
  std::call_once(once, [] { curl_global_init(CURL_GLOBAL_DEFAULT); });
}

// Downloads `url` into `partial` (resuming what is there), hashing as it arrives; the digest of
// the whole file on success.
Result<std::string> Fetch(const ImageCacheOptions& o, const v1::ImageRef& img,
                          const std::string& partial, const ProgressFn& progress) {
  CurlInitOnce();
  const std::string& url = img.url();
  std::map<std::string, std::string> det = {{"url", url}};
  Fd fd(::open(partial.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600));
  if (!fd.ok()) {
    return Fail(Code::kInternal, reason::kImageCacheUnusable, partial + ": " + Errno(errno));
  }
  Sha256 hash;
  struct stat st {};
  ::fstat(fd.get(), &st);
  uint64_t have = static_cast<uint64_t>(st.st_size);
  if (have > 0 && !HashPrefix(fd.get(), have, hash)) {
    hash.Reset();
    have = 0;
  }
  if (have == 0 && ::ftruncate(fd.get(), 0) != 0) {
    return Fail(Code::kInternal, reason::kImageCacheUnusable, partial + ": " + Errno(errno));
  }
  if (have > 0) {
    progress(kStage, fmt::format("resuming {} at {}", img.name(), Human(static_cast<double>(have))),
             0);
  }
  const auto deadline = Clock::now() + o.timeout;
  auto delay = o.retry_delay;
  std::string last_error;
  for (int attempt = 1;; ++attempt) {
    FetchState fs_state;
    fs_state.fd = fd.get();
    fs_state.offset = have;
    fs_state.start_offset = have;
    fs_state.hash = &hash;
    fs_state.t0 = Clock::now();
    fs_state.last_report = fs_state.t0;
    fs_state.deadline = deadline;
    fs_state.progress = &progress;
    fs_state.name = img.name();
    std::unique_ptr<CURL, decltype(&curl_easy_cleanup)> curl(curl_easy_init(), &curl_easy_cleanup);
    if (!curl) {
      return Fail(Code::kInternal, reason::kImageFetchFailed, "curl_easy_init failed", det);
    }
    char errbuf[CURL_ERROR_SIZE] = {0};
    CURL* c = curl.get();
    curl_easy_setopt(c, CURLOPT_URL, url.c_str());
    curl_easy_setopt(c, CURLOPT_PROTOCOLS_STR, "http,https,file");
    curl_easy_setopt(c, CURLOPT_REDIR_PROTOCOLS_STR, "http,https");
    curl_easy_setopt(c, CURLOPT_FOLLOWLOCATION, 1L);
    curl_easy_setopt(c, CURLOPT_MAXREDIRS, 5L);
    curl_easy_setopt(c, CURLOPT_FAILONERROR, 1L);
    curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(c, CURLOPT_CONNECTTIMEOUT, 30L);
    curl_easy_setopt(c, CURLOPT_LOW_SPEED_LIMIT, 1L);
    curl_easy_setopt(c, CURLOPT_LOW_SPEED_TIME, static_cast<long>(o.stall_timeout.count()));
    curl_easy_setopt(c, CURLOPT_USERAGENT, "gpuaas-node-agent");
    curl_easy_setopt(c, CURLOPT_ERRORBUFFER, errbuf);
    curl_easy_setopt(c, CURLOPT_BUFFERSIZE, 512L * 1024);
    curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, &OnData);
    curl_easy_setopt(c, CURLOPT_WRITEDATA, &fs_state);
    curl_easy_setopt(c, CURLOPT_NOPROGRESS, 0L);
    curl_easy_setopt(c, CURLOPT_XFERINFOFUNCTION, &OnProgress);
    curl_easy_setopt(c, CURLOPT_XFERINFODATA, &fs_state);
    if (have > 0) curl_easy_setopt(c, CURLOPT_RESUME_FROM_LARGE, static_cast<curl_off_t>(have));
    const CURLcode rc = curl_easy_perform(c);
    long http = 0;
    curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &http);
    have = fs_state.offset;
    if (rc == CURLE_OK) break;
    const std::string why = errbuf[0] ? errbuf : curl_easy_strerror(rc);
    det["curl_code"] = std::to_string(static_cast<int>(rc));
    if (http > 0) det["http_status"] = std::to_string(http);
    if (rc == CURLE_WRITE_ERROR && fs_state.write_failed) {
      return Fail(Code::kInternal, reason::kImageCacheUnusable,
                  partial + ": " + Errno(fs_state.write_errno), det);
    }
    if (rc == CURLE_ABORTED_BY_CALLBACK) {
      return Fail(Code::kDeadlineExceeded, reason::kImageFetchFailed,
                  fmt::format("fetching {} took longer than {} s", img.name(),
                              std::chrono::duration_cast<std::chrono::seconds>(o.timeout).count()),
                  det);
    }
    if (rc == CURLE_RANGE_ERROR || (rc == CURLE_HTTP_RETURNED_ERROR && http == 416)) {
      // The server cannot resume this prefix: start over (not a failed attempt).
      progress(kStage,
               fmt::format("{}: the server cannot resume; fetching from the start", img.name()), 0);
      hash.Reset();
      have = 0;
      if (::ftruncate(fd.get(), 0) != 0) {
        return Fail(Code::kInternal, reason::kImageCacheUnusable, partial + ": " + Errno(errno),
                    det);
      }
      if (rc == CURLE_RANGE_ERROR || attempt < o.fetch_attempts) continue;
    }
    if (rc == CURLE_FILE_COULDNT_READ_FILE ||
        (rc == CURLE_HTTP_RETURNED_ERROR && (http == 404 || http == 410))) {
      return Fail(Code::kNotFound, reason::kImageNotFound,
                  fmt::format("image {}: nothing at {} ({})", img.name(), url, why), det);
    }
    if (!Transient(rc, http)) {
      return Fail(Code::kFailedPrecondition, reason::kImageFetchFailed,
                  fmt::format("fetching {} from {}: {}", img.name(), url, why), det);
    }
    last_error = why;
    if (attempt >= o.fetch_attempts || Clock::now() + delay >= deadline) {
      Error e = Fail(Code::kUnavailable, reason::kImageFetchFailed,
                     fmt::format("fetching {} from {}: {} (after {} attempts; {} kept to resume)",
                                 img.name(), url, why, attempt, Human(static_cast<double>(have))),
                     det);
      e.retryable = true;
      return e;
    }
    progress(
        kStage,
        fmt::format("fetching {}: {}; attempt {} of {} resumes at {} in {} ms", img.name(), why,
                    attempt + 1, o.fetch_attempts, Human(static_cast<double>(have)), delay.count()),
        0);
    std::this_thread::sleep_for(delay);
    delay = std::min<milliseconds>(delay * 2, std::chrono::seconds(30));
  }
  if (::fsync(fd.get()) != 0) {
    return Fail(Code::kInternal, reason::kImageCacheUnusable, partial + ": " + Errno(errno), det);
  }
  return hash.Hex();
}

// ---------------------------------------------------------------------------------------------
// Cache entries.

struct Identity {
  uint64_t dev = 0, ino = 0, size = 0;
  int64_t mtime_ns = 0;
  bool operator==(const Identity&) const = default;
};

std::optional<Identity> IdentityOf(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) return std::nullopt;
  return Identity{static_cast<uint64_t>(st.st_dev), static_cast<uint64_t>(st.st_ino),
                  static_cast<uint64_t>(st.st_size),
                  static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec};
}

nlohmann::json ToJson(const Identity& id) {
  return {{"dev", id.dev}, {"ino", id.ino}, {"size", id.size}, {"mtime_ns", id.mtime_ns}};
}

std::string Paths(const ImageCacheOptions& o, const std::string& sha, const char* ext) {
  return fmt::format("{}/{}.{}", o.dir, sha, ext);
}

// The entry's record, when it is complete and its raw file is still the one it describes.
std::optional<CachedImage> LoadEntry(const ImageCacheOptions& o, const v1::ImageRef& img) {
  std::ifstream f(Paths(o, img.sha256(), "json"));
  if (!f) return std::nullopt;
  auto j = nlohmann::json::parse(f, nullptr, false);
  if (j.is_discarded() || !j.is_object() || j.value("sha256", "") != img.sha256()) {
    return std::nullopt;
  }
  const std::string raw = j.value("raw", "");
  if (raw.empty() || raw.find('/') != std::string::npos) return std::nullopt;
  CachedImage c;
  c.name = img.name();
  c.path = o.dir + "/" + raw;
  c.format = j.value("format", "");
  c.sha256 = j.value("raw_sha256", "");
  c.size = j.value("size", uint64_t{0});
  auto id = IdentityOf(c.path);
  if (!id || !j.contains("identity") || ToJson(*id) != j["identity"] || id->size != c.size ||
      !IsValidSha256(c.sha256)) {
    return std::nullopt;
  }
  return c;
}

Result<void> SaveEntry(const ImageCacheOptions& o, const CachedImage& c,
                       const std::string& catalog_sha) {
  auto id = IdentityOf(c.path);
  if (!id) return Fail(Code::kInternal, reason::kImageCacheUnusable, c.path + " vanished");
  const nlohmann::json j = {{"sha256", catalog_sha},  {"name", c.name},
                            {"format", c.format},     {"raw", fs::path(c.path).filename().string()},
                            {"raw_sha256", c.sha256}, {"size", c.size},
                            {"identity", ToJson(*id)}};
  const std::string path = Paths(o, catalog_sha, "json");
  const std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp, std::ios::trunc);
    f << j.dump(2) << "\n";
    f.close();
    if (!f) return Fail(Code::kInternal, reason::kImageCacheUnusable, "writing " + tmp);
  }
  std::error_code ec;
  fs::rename(tmp, path, ec);
  if (ec) return Fail(Code::kInternal, reason::kImageCacheUnusable, path + ": " + ec.message());
  return Ok();
}

struct Probe {
  std::string format;
  uint64_t virtual_size = 0;
};

// qemu-img's own reading of the file (once per cache entry): its format and virtual size; a
// backing file or a format other than raw and qcow2 is refused.
Result<Probe> ProbeImage(const ImageCacheOptions& o, const std::string& path) {
  auto qemu_img = FindToolIn(o.tools_root, "qemu-img", kStage);
  if (!qemu_img.ok()) return qemu_img.error();
  auto r = RunOk({*qemu_img, "info", "--output=json", path}, milliseconds(60000), kStage,
                 reason::kImageUnreadable);
  if (!r.ok()) return r.error();
  auto j = nlohmann::json::parse(r->out, nullptr, false);
  if (j.is_discarded() || !j.is_object()) {
    return Fail(Code::kInternal, reason::kImageUnreadable, "qemu-img info printed no JSON");
  }
  Probe p;
  p.format = j.value("format", "");
  p.virtual_size = j.value("virtual-size", uint64_t{0});
  // A backing file would make qemu read another file of the image's choosing.
  if (j.contains("backing-filename") || j.contains("full-backing-filename")) {
    return Fail(Code::kFailedPrecondition, reason::kImageHasBackingFile,
                "images with a backing file are refused");
  }
  if (p.format != "raw" && p.format != "qcow2") {
    return Fail(Code::kFailedPrecondition, reason::kImageFormatUnsupported,
                "image format '" + p.format + "' (only raw and qcow2)", {{"format", p.format}});
  }
  return p;
}

// qcow2 -> <sha>.raw once, its digest recorded (one read of the result).
Result<CachedImage> DeriveRaw(const ImageCacheOptions& o, const v1::ImageRef& img,
                              const std::string& qcow2, const Probe& p,
                              const ProgressFn& progress) {
  auto qemu_img = FindToolIn(o.tools_root, "qemu-img", kStage);
  if (!qemu_img.ok()) return qemu_img.error();
  const std::string raw = Paths(o, img.sha256(), "raw");
  const std::string tmp = raw + ".partial";
  progress(kStage,
           fmt::format("{}: converting qcow2 to a raw copy in the cache ({}), once", img.name(),
                       Human(static_cast<double>(p.virtual_size))),
           45);
  auto r = RunOk({*qemu_img, "convert", "-f", "qcow2", "-O", "raw", qcow2, tmp}, o.timeout, kStage,
                 reason::kImageUnreadable);
  if (!r.ok()) {
    std::error_code ec;
    fs::remove(tmp, ec);
    return r.error();
  }
  auto digest = Sha256File(tmp);
  if (!digest.ok()) return digest.error();
  std::error_code ec;
  fs::rename(tmp, raw, ec);
  if (ec) return Fail(Code::kInternal, reason::kImageCacheUnusable, raw + ": " + ec.message());
  fs::remove(qcow2, ec);  // the raw copy is what provisions read
  CachedImage c;
  c.name = img.name();
  c.path = raw;
  c.format = "qcow2";
  c.sha256 = *digest;
  auto id = IdentityOf(raw);
  c.size = id ? id->size : 0;
  return c;
}

}  // namespace

Result<std::string> Sha256File(const std::string& path) {
  Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd.ok()) return Fail(Code::kInternal, reason::kImageUnreadable, path + ": " + Errno(errno));
  struct stat st {};
  ::fstat(fd.get(), &st);
  ::posix_fadvise(fd.get(), 0, 0, POSIX_FADV_SEQUENTIAL);
  Sha256 h;
  if (!HashPrefix(fd.get(), static_cast<uint64_t>(st.st_size), h)) {
    return Fail(Code::kInternal, reason::kImageUnreadable, "reading " + path);
  }
  return h.Hex();
}

ImageCache::ImageCache(ImageCacheOptions opts) : opts_(std::move(opts)) {}
ImageCache::~ImageCache() = default;

namespace {

// The image's entry, exclusively: an flock on <sha256>.lock, held while the returned descriptor
// is open. Every open of the file is its own lock owner, so it serialises this process's threads
// as well as other processes. `on_wait` runs when someone else holds it.
Result<std::unique_ptr<Fd>> LockEntry(const ImageCacheOptions& o, const std::string& sha256,
                                      const std::function<void()>& on_wait) {
  const std::string path = Paths(o, sha256, "lock");
  auto fd = std::make_unique<Fd>(::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600));
  if (!fd->ok()) {
    return Fail(Code::kInternal, reason::kImageCacheUnusable, path + ": " + Errno(errno));
  }
  if (::flock(fd->get(), LOCK_EX | LOCK_NB) == 0) return fd;
  if (errno == EWOULDBLOCK && on_wait) on_wait();
  int r = 0;
  while ((r = ::flock(fd->get(), LOCK_EX)) != 0 && errno == EINTR) {
  }
  if (r != 0) return Fail(Code::kInternal, reason::kImageCacheUnusable, path + ": " + Errno(errno));
  return fd;
}

}  // namespace

void ImageCache::Evict(const std::string& sha256) {
  if (!IsValidSha256(sha256)) return;
  auto lock = LockEntry(opts_, sha256, {});
  std::error_code ec;
  for (const char* ext : {"json", "img", "raw"}) fs::remove(Paths(opts_, sha256, ext), ec);
}

Result<CachedImage> ImageCache::Ensure(const v1::ImageRef& img, const ProgressFn& progress) {
  const std::string& want = img.sha256();
  const std::string& url = img.url();
  if (!IsValidSha256(want)) {
    return Fail(Code::kInvalidArgument, reason::kInvalidBundle,
                "image sha256 must be 64 hex digits");
  }
  if (url.rfind("file:///", 0) != 0 && url.rfind("http://", 0) != 0 &&
      url.rfind("https://", 0) != 0) {
    return Fail(Code::kInvalidArgument, reason::kImageUrlUnsupported,
                "image URL must be file://, http:// or https://: '" + url + "'", {{"url", url}});
  }
  std::error_code ec;
  fs::create_directories(opts_.dir, ec);
  if (ec) {
    return Fail(Code::kInternal, reason::kImageCacheUnusable, opts_.dir + ": " + ec.message());
  }

  // One fetch per image: a provision that finds another one fetching it waits for its result.
  auto lock = LockEntry(opts_, want, [&] {
    progress(kStage,
             fmt::format("{}: another provision on this node is fetching it; waiting", img.name()),
             0);
  });
  if (!lock.ok()) return lock.error();
  if (auto hit = LoadEntry(opts_, img)) {
    progress(kStage,
             fmt::format("{}: in the node's cache ({} raw)", img.name(),
                         Human(static_cast<double>(hit->size))),
             50);
    return *hit;
  }
  fs::remove(Paths(opts_, want, "json"), ec);
  const std::string cached = Paths(opts_, want, "img");
  bool verified = false;
  if (fs::exists(cached, ec)) {
    // An image without its record (an older cache, or a crash before the record): verified once.
    progress(kStage, fmt::format("{}: in the cache without a record; verifying it", img.name()), 0);
    auto got = Sha256File(cached);
    verified = got.ok() && *got == want;
    if (!verified) fs::remove(cached, ec);
  }
  if (!verified) {
    progress(kStage, fmt::format("fetching {} from {}", img.name(), url), 0);
    const std::string partial = Paths(opts_, want, "partial");
    const auto t0 = Clock::now();
    auto got = Fetch(opts_, img, partial, progress);
    if (!got.ok()) return got.error();
    if (*got != want) {
      fs::remove(partial, ec);
      return Fail(
          Code::kFailedPrecondition, reason::kImageDigestMismatch,
          fmt::format("image {} has sha256 {}, the bundle wants {}", img.name(), *got, want),
          {{"expected_sha256", want}, {"actual_sha256", *got}, {"url", url}});
    }
    fs::rename(partial, cached, ec);
    if (ec) return Fail(Code::kInternal, reason::kImageCacheUnusable, cached + ": " + ec.message());
    const auto size = IdentityOf(cached).value_or(Identity{}).size;
    const ByteProgress b = Bytes("fetch", size, size, t0);
    progress(kStage, fmt::format("fetched {} ({}), sha256 verified", img.name(), Rate(b)), 45, b);
  }
  auto probe = ProbeImage(opts_, cached);
  if (!probe.ok()) return probe.error();
  CachedImage c;
  if (probe->format == "qcow2") {
    auto d = DeriveRaw(opts_, img, cached, *probe, progress);
    if (!d.ok()) return d.error();
    c = *d;
  } else {
    c.name = img.name();
    c.path = cached;
    c.format = "raw";
    c.sha256 = want;
    c.size = IdentityOf(cached).value_or(Identity{}).size;
  }
  if (auto s = SaveEntry(opts_, c, want); !s.ok()) return s.error();
  progress(kStage,
           fmt::format("{}: cached ({} raw)", img.name(), Human(static_cast<double>(c.size))), 50);
  return c;
}

// ---------------------------------------------------------------------------------------------
// The write.

namespace {

bool PwriteAll(int fd, const char* p, size_t n, uint64_t off) {
  size_t done = 0;
  while (done < n) {
    const ssize_t w = ::pwrite(fd, p + done, n - done, static_cast<off_t>(off + done));
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    done += static_cast<size_t>(w);
  }
  return true;
}

// The cached file mapped read-only: the hash and the O_DIRECT writes both read the page cache's
// own pages, with no copy between them. (The cache's files are the agent's, 0600, and are only
// ever replaced by rename, never truncated in place, so the mapping cannot lose its pages.)
class Mapping {
 public:
  Mapping(int fd, size_t n) : n_(n) {
    if (n == 0) return;
    void* p = ::mmap(nullptr, n, PROT_READ, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) return;
    p_ = static_cast<const char*>(p);
    ::madvise(const_cast<char*>(p_), n, MADV_SEQUENTIAL);
  }
  ~Mapping() {
    if (p_) ::munmap(const_cast<char*>(p_), n_);
  }
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  const char* data() const { return p_; }
  bool ok() const { return p_ != nullptr || n_ == 0; }

 private:
  const char* p_ = nullptr;
  size_t n_;
};

}  // namespace

Result<WriteStats> WriteImage(const CachedImage& image, const std::string& path, bool block,
                              uint64_t size, milliseconds timeout, const ProgressFn& progress) {
  std::map<std::string, std::string> det = {{"path", path}};
  Fd src(::open(image.path.c_str(), O_RDONLY | O_CLOEXEC));
  struct stat sst {};
  if (!src.ok() || ::fstat(src.get(), &sst) != 0) {
    return Fail(Code::kInternal, reason::kImageChanged, image.path + ": " + Errno(errno), det);
  }
  const uint64_t n = image.size;
  if (static_cast<uint64_t>(sst.st_size) != n) {
    return Fail(
        Code::kInternal, reason::kImageChanged,
        fmt::format("{} has {} bytes, its cache record says {}", image.path, sst.st_size, n), det);
  }
  if (n > size && block) {
    return Fail(Code::kFailedPrecondition, reason::kDiskTooSmall,
                fmt::format("image needs {} bytes, {} has {}", n, path, size), det);
  }
  // O_DIRECT: the disk's speed, not the page cache's; O_EXCL: nothing mounts or claims the device
  // while the image lands. A fixture's regular file goes through the page cache, then is synced.
  const bool direct = block;
  Fd dst(::open(path.c_str(), O_WRONLY | O_CLOEXEC | (block ? O_DIRECT | O_EXCL : 0)));
  if (!dst.ok()) {
    return Fail(Code::kInternal, reason::kImageWriteFailed, "opening " + path + ": " + Errno(errno),
                det);
  }
  size_t sector = 512;
  if (block) {
    int ss = 0;
    if (::ioctl(dst.get(), BLKSSZGET, &ss) == 0 && ss > 0) sector = static_cast<size_t>(ss);
  } else if (n > size && ::ftruncate(dst.get(), static_cast<off_t>(n)) != 0) {
    return Fail(Code::kInternal, reason::kImageWriteFailed, path + ": " + Errno(errno), det);
  }
  Mapping map(src.get(), static_cast<size_t>(n));
  if (!map.ok()) {
    return Fail(Code::kInternal, reason::kImageChanged,
                "mapping " + image.path + ": " + Errno(errno), det);
  }
  const char* bytes = map.data();
  // Writes [off, off+len) of the image; with O_DIRECT a last piece shorter than a sector goes
  // through an aligned copy padded with zeros (the disk is a whole number of sectors).
  auto write_range = [&](uint64_t off, size_t len) {
    const size_t whole = direct ? len / sector * sector : len;
    if (whole > 0 && !PwriteAll(dst.get(), bytes + off, whole, off)) return false;
    if (whole == len) return true;
    const size_t rest = len - whole;
    const size_t padded = (rest + sector - 1) / sector * sector;
    auto tail = NewBuffer(std::max(padded, kAlign));
    std::memset(tail.get(), 0, padded);
    std::memcpy(tail.get(), bytes + off + whole, rest);
    return PwriteAll(dst.get(), tail.get(), padded, off + whole);
  };

  const auto t0 = Clock::now();
  const auto deadline = t0 + timeout;
  // The head: zeroed on the disk now, written last (only once the digest matched).
  const size_t head_len = static_cast<size_t>(std::min<uint64_t>(kChunk, n));
  if (head_len > 0) {
    const size_t zlen = direct ? (head_len + sector - 1) / sector * sector : head_len;
    auto zeros = NewBuffer(std::max(zlen, kAlign));
    std::memset(zeros.get(), 0, zlen);
    if (!PwriteAll(dst.get(), zeros.get(), zlen, 0)) {
      return Fail(Code::kInternal, reason::kImageWriteFailed,
                  "zeroing the head of " + path + ": " + Errno(errno), det);
    }
  }
  // The writer streams the rest onto the disk while this thread hashes the whole: two cores, one
  // read of the page cache each, no copy.
  std::atomic<uint64_t> written{0};
  std::atomic<bool> stop{false};
  std::string write_error;
  std::thread writer([&] {
    for (uint64_t off = head_len; off < n && !stop.load(); off += kChunk) {
      const size_t len = static_cast<size_t>(std::min<uint64_t>(kChunk, n - off));
      if (!write_range(off, len)) {
        write_error = fmt::format("writing {} at {}: {}", path, off, Errno(errno));
        return;
      }
      written += len;
    }
  });
  Sha256 hash;
  bool timed_out = false;
  auto last_report = t0;
  for (uint64_t off = 0; off < n; off += kChunk) {
    hash.Update(bytes + off, static_cast<size_t>(std::min<uint64_t>(kChunk, n - off)));
    const auto now = Clock::now();
    if (now >= deadline) {
      timed_out = true;
      break;
    }
    if (now - last_report >= std::chrono::seconds(1)) {
      last_report = now;
      const ByteProgress b = Bytes("write", head_len + written.load(), n, t0);
      progress(kStage, fmt::format("writing {}: {}", image.name, Rate(b)),
               50 + static_cast<int>(49 * b.done / std::max<uint64_t>(n, 1)), b);
    }
  }
  if (timed_out) stop = true;
  writer.join();
  if (timed_out) {
    return Fail(Code::kDeadlineExceeded, reason::kImageWriteFailed,
                fmt::format("writing {} took longer than {} s", path,
                            std::chrono::duration_cast<std::chrono::seconds>(timeout).count()),
                det);
  }
  if (!write_error.empty()) {
    return Fail(Code::kInternal, reason::kImageWriteFailed, write_error, det);
  }
  const std::string got = hash.Hex();
  if (got != image.sha256) {
    det["expected_sha256"] = image.sha256;
    det["actual_sha256"] = got;
    return Fail(Code::kFailedPrecondition, reason::kImageDigestMismatch,
                fmt::format("{} read back as sha256 {}, expected {}: the disk was left unbootable",
                            image.path, got, image.sha256),
                det);
  }
  if (head_len > 0 && !write_range(0, head_len)) {
    return Fail(Code::kInternal, reason::kImageWriteFailed,
                "writing the head of " + path + ": " + Errno(errno), det);
  }
  if (::fdatasync(dst.get()) != 0) {
    return Fail(Code::kInternal, reason::kImageWriteFailed, "syncing " + path + ": " + Errno(errno),
                det);
  }
  WriteStats st;
  st.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  const ByteProgress b = Bytes("write", n, n, t0);
  progress(kStage, fmt::format("wrote {} onto {}: {}, sha256 verified", image.name, path, Rate(b)),
           99, b);
  return st;
}

}  // namespace gpuaas::node_agent
