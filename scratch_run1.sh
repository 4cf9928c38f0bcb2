source .gpu/env.sh
pip install -e . --no-deps -q >/dev/null 2>&1
nvidia-smi --query-gpu=name,clocks.sm,power.draw --format=csv,noheader
timeout 200 python3 -m pytest -q -m gpu tests/test_gpu_kernel.py -k stream_k -x 2>&1 | tail -15 | tee $OUT/sk_tests.log
B="python3 benchmarks/run.py --epilogues gemm,bias+gelu_tanh"
timeout 300 $B --shapes 8192,8192,8192 8192,4096,14336 4096,14336,4096 16384,4096,14336 8192,14336,4096 \
  --configs auto 128,128,1,2,swizzle=8,pingpong=1,stream_k=0 --json $OUT/ab.json > $OUT/ab.log 2>&1
tail -30 $OUT/ab.log
