"""zs_proto_library: C++ protobuf + gRPC code from .proto files.

Runs the system protoc (Debian's protobuf-compiler-grpc) with the workspace
root as import path, so a proto is imported and its header included as
"proto/zeroshard/v1/<name>.pb.h".
"""

_GRPC_PLUGIN = "/usr/bin/grpc_cpp_plugin"

def zs_proto_library(name, srcs, deps = [], grpc_services = True, visibility = None):
    """Generates <src>.pb.{h,cc} (+ .grpc.pb.{h,cc}) and cc_library targets.

    `name` has every message and, with grpc_services, the service stubs
    (and gRPC); with grpc_services, `name`_messages has the messages alone,
    for code that reads and writes them but calls and serves no RPC (it
    then depends on protobuf, not on gRPC).

    Args:
      name: the cc_library target.
      srcs: .proto files in this package; they may import each other.
      deps: other zs_proto_library targets whose protos srcs import.
      grpc_services: also generate gRPC service stubs.
      visibility: of the cc_library targets.
    """
    bases = [s[:-len(".proto")] for s in srcs]
    messages = [b + ".pb.h" for b in bases] + [b + ".pb.cc" for b in bases]
    native.genrule(
        name = name + "_gen",
        srcs = srcs,
        outs = messages,
        cmd = "protoc -I. --cpp_out=$(GENDIR) $(SRCS)",
        message = "protoc " + native.package_name(),
    )
    if not grpc_services:
        native.cc_library(
            name = name,
            srcs = [o for o in messages if o.endswith(".cc")],
            hdrs = [o for o in messages if o.endswith(".h")],
            deps = deps + ["//third_party:protobuf"],
            visibility = visibility,
        )
        return
    native.cc_library(
        name = name + "_messages",
        srcs = [o for o in messages if o.endswith(".cc")],
        hdrs = [o for o in messages if o.endswith(".h")],
        deps = [d + "_messages" for d in deps] + ["//third_party:protobuf"],
        visibility = visibility,
    )
    services = [b + ".grpc.pb.h" for b in bases] + [b + ".grpc.pb.cc" for b in bases]
    native.genrule(
        name = name + "_grpc_gen",
        srcs = srcs,
        outs = services,
        cmd = ("protoc -I. --grpc_out=$(GENDIR) " +
               "--plugin=protoc-gen-grpc=%s $(SRCS)" % _GRPC_PLUGIN),
        message = "protoc (gRPC) " + native.package_name(),
    )
    native.cc_library(
        name = name,
        srcs = [o for o in services if o.endswith(".cc")],
        hdrs = [o for o in services if o.endswith(".h")],
        deps = deps + [":" + name + "_messages", "//third_party:grpc", "//third_party:protobuf"],
        visibility = visibility,
    )
