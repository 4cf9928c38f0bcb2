"""Where a fused GEMM's SM cycles go: the kernel's timeline build, summarized per epilogue.

    python benchmarks/timeline.py [--shape M,N,K[,L]] [--epilogues gemm bias+gelu_tanh ...]
                                  [--configs auto 128,128,1,2,pingpong=1,epi_n=16 ...] [--by-position]

See ``jax_efc.timeline`` for what each column means. Needs an sm_90 GPU.
"""

from jax_efc.timeline import main

if __name__ == "__main__":
    main()
