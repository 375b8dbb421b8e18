"""zs_proto_library: C++ protobuf + gRPC code from .proto files.

Runs the system protoc (Debian's protobuf-compiler-grpc) with the workspace
root as import path, so a proto is imported and its header included as
"proto/zeroshard/v1/<name>.pb.h".
"""

_GRPC_PLUGIN = "/usr/bin/grpc_cpp_plugin"

def zs_proto_library(name, srcs, deps = [], grpc_services = True, visibility = None):
    """Generates <src>.pb.{h,cc} (+ .grpc.pb.{h,cc}) and a cc_library `name`.

    Args:
      name: the cc_library target.
      srcs: .proto files in this package; they may import each other.
      deps: other zs_proto_library targets whose protos srcs import.
      grpc_services: also generate gRPC service stubs.
      visibility: of the cc_library.
    """
    bases = [s[:-len(".proto")] for s in srcs]
    outs = [b + ".pb.h" for b in bases] + [b + ".pb.cc" for b in bases]
    if grpc_services:
        outs += [b + ".grpc.pb.h" for b in bases] + [b + ".grpc.pb.cc" for b in bases]
    cmd = "protoc -I. --cpp_out=$(GENDIR) $(SRCS)"
    if grpc_services:
        cmd = ("protoc -I. --cpp_out=$(GENDIR) --grpc_out=$(GENDIR) " +
               "--plugin=protoc-gen-grpc=%s $(SRCS)" % _GRPC_PLUGIN)
    native.genrule(
        name = name + "_gen",
        srcs = srcs,
        outs = outs,
        cmd = cmd,
        message = "protoc " + native.package_name(),
    )
    native.cc_library(
        name = name,
        srcs = [o for o in outs if o.endswith(".cc")],
        hdrs = [o for o in outs if o.endswith(".h")],
        deps = deps + ["//third_party:grpc", "//third_party:protobuf"],
        visibility = visibility,
    )
