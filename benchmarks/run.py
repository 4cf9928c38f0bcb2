"""The standard benchmark: jax_efc's fused GEMMs vs plain JAX, side by side.

    python benchmarks/run.py [--quick] [--also-no-triton] [--json out.json [--resume]]
                             [--shapes M,N,K ...]

All options are those of ``python -m jax_efc.bench`` (see ``--help``).
"""

from jax_efc.bench import main

if __name__ == "__main__":
    main()
