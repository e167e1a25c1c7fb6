# Source on the GPU host after a bundle's install.sh (`source .gpu-bundle*/install.sh`): puts the
# unpacked bundle on PYTHONPATH through a folder named site-packages. quack keys its compiled
# epilogues by the globals of the code they call, except code under site-packages, which it keys by
# name; the CUTLASS DSL's globals hold a ContextVar it cannot key, so experts:quack_gated's gated
# GEMM compiles only when the DSL is imported from such a folder (a pip install always is).
mkdir -p /tmp/gpu-site-link && ln -sfn /tmp/gpu-site /tmp/gpu-site-link/site-packages
export PYTHONPATH=".:/tmp/gpu-site-link/site-packages/nvidia_cutlass_dsl/dsl_packages:/tmp/gpu-site-link/site-packages"
