"""Detects CUDA and NCCL on the build machine.

Generates @local_cuda with:
  //:defs.bzl  CUDA_FOUND (bool), CUDA_PATH (string)
  //:cuda      cc_library linking cudart + nccl (empty when not found)
CUDA is looked for at $CUDA_PATH, then /usr/local/cuda; it needs bin/nvcc,
include/cuda_runtime.h and include/nccl.h. Without it, cuda/ targets are left
out and everything else builds and tests. CUDA_PATH=none builds without CUDA
on a machine that has it (`bazel ... --repo_env=CUDA_PATH=none`), to test
the build a machine without CUDA gets.
"""

def _cuda_configure_impl(ctx):
    candidates = []
    env_path = ctx.os.environ.get("CUDA_PATH", "")
    if env_path == "none":
        pass
    elif env_path:
        candidates.append(env_path)
        candidates.append("/usr/local/cuda")
    else:
        candidates.append("/usr/local/cuda")
    found = ""
    for path in candidates:
        if (ctx.path(path + "/bin/nvcc").exists and
            ctx.path(path + "/include/cuda_runtime.h").exists and
            ctx.path(path + "/include/nccl.h").exists):
            found = path
            break
    ctx.file("WORKSPACE", "workspace(name = \"%s\")\n" % ctx.name)
    ctx.file("defs.bzl", "CUDA_FOUND = %s\nCUDA_PATH = \"%s\"\n" % (
        "True" if found else "False",
        found,
    ))
    if found:
        ctx.symlink(found + "/include", "include")
        build = """
package(default_visibility = ["//visibility:public"])
cc_library(
    name = "cuda",
    hdrs = glob(["include/**/*.h", "include/**/*.hpp", "include/**/*.inl"]),
    includes = ["include"],
    linkopts = ["-L%s/lib64", "-L%s/lib", "-Wl,-rpath,%s/lib64", "-lcudart", "-lnccl"],
)
""" % (found, found, found)
    else:
        build = """
package(default_visibility = ["//visibility:public"])
cc_library(name = "cuda")
"""
    ctx.file("BUILD.bazel", build)

cuda_configure = repository_rule(
    implementation = _cuda_configure_impl,
    environ = ["CUDA_PATH"],
    local = True,
)
