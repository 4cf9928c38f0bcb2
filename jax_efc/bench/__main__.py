from jax_efc.bench.command import main

main()
