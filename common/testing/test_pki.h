#pragma once

// A throwaway PKI for TLS tests: make_test_certs.sh (beside this file; add
// //common/testing:make_test_certs to the test's data) run into a fresh
// temporary directory, which the destructor removes. Blocks while openssl
// runs (about a second).

#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>

#include "gtest/gtest.h"

namespace zeroshard::testing {

class TestPki {
 public:
  // Null (with a test failure) when the directory or the certificates
  // cannot be made.
  static std::unique_ptr<TestPki> Create() {
    char tmpl[] = "/tmp/zs-test-pki-XXXXXX";
    if (::mkdtemp(tmpl) == nullptr) {
      ADD_FAILURE() << "mkdtemp failed";
      return nullptr;
    }
    std::unique_ptr<TestPki> pki(new TestPki(tmpl));
    const std::string cmd =
        "common/testing/make_test_certs.sh " + pki->dir_ + " > " + pki->dir_ + "/make.log 2>&1";
    if (std::system(cmd.c_str()) != 0) {
      ADD_FAILURE() << cmd << " failed; see " << pki->dir_ << "/make.log";
      return nullptr;
    }
    return pki;
  }
  ~TestPki() { std::filesystem::remove_all(dir_); }

  // dir/name: ca.crt, server.{crt,key}, client.{crt,key}, admin.{crt,key},
  // norole.{crt,key}, expired.{crt,key}, other_ca.crt, stranger.{crt,key}
  // (make_test_certs.sh says what each is and which role it names).
  std::string File(const std::string& name) const { return dir_ + "/" + name; }

 private:
  explicit TestPki(std::string dir) : dir_(std::move(dir)) {}
  const std::string dir_;
};

}  // namespace zeroshard::testing
