#include "metrics/promtool_testutil.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace zeroshard::metrics::testing {

std::string FindPromtool() {
  const char* path = getenv("PATH");
  std::vector<std::string> dirs;
  if (path != nullptr) dirs = absl::StrSplit(path, ':', absl::SkipEmpty());
  dirs.push_back("/usr/bin");
  for (const std::string& dir : dirs) {
    std::string candidate = absl::StrCat(dir, "/promtool");
    if (access(candidate.c_str(), X_OK) == 0) return candidate;
  }
  return "";
}

CommandResult RunPromtool(const std::string& promtool, const std::string& args,
                          absl::string_view input) {
  CommandResult result;
  const char* tmp = getenv("TEST_TMPDIR");
  std::string input_path =
      absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/promtool_input_XXXXXX");
  const int fd = mkstemp(input_path.data());
  if (fd < 0) return result;
  const bool written = write(fd, input.data(), input.size()) ==
                       static_cast<ssize_t>(input.size());
  close(fd);
  if (written) {
    const std::string command =
        absl::StrCat("'", promtool, "' ", args, " < '", input_path, "' 2>&1");
    if (FILE* pipe = popen(command.c_str(), "r"); pipe != nullptr) {
      char buf[4096];
      size_t n;
      while ((n = fread(buf, 1, sizeof(buf), pipe)) > 0) {
        result.output.append(buf, n);
      }
      const int status = pclose(pipe);
      result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    }
  }
  unlink(input_path.c_str());
  return result;
}

HttpResponse Fetch(int port, const std::string& method,
                   const std::string& path) {
  HttpResponse response;
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return response;
  timeval timeout = {10, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &timeout, sizeof(timeout));
  sockaddr_in addr = {};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    return response;
  }
  const std::string request =
      absl::StrCat(method, " ", path, " HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n");
  if (send(fd, request.data(), request.size(), 0) !=
      static_cast<ssize_t>(request.size())) {
    close(fd);
    return response;
  }
  std::string raw;
  char buf[4096];
  ssize_t n;
  while ((n = recv(fd, buf, sizeof(buf), 0)) > 0) raw.append(buf, n);
  close(fd);
  const size_t end = raw.find("\r\n\r\n");
  if (end == std::string::npos || !absl::StartsWith(raw, "HTTP/1.")) {
    return response;
  }
  response.headers = raw.substr(0, end);
  response.body = raw.substr(end + 4);
  response.status = std::atoi(raw.c_str() + raw.find(' ') + 1);
  return response;
}

std::string ReadRunfile(const std::string& path) {
  const char* srcdir = std::getenv("TEST_SRCDIR");
  const char* workspace = std::getenv("TEST_WORKSPACE");
  const std::string full = srcdir != nullptr && workspace != nullptr
                               ? absl::StrCat(srcdir, "/", workspace, "/", path)
                               : path;
  std::ifstream in(full);
  std::stringstream buffer;
  buffer << in.rdbuf();
  return buffer.str();
}

}  // namespace zeroshard::metrics::testing
