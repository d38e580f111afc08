from helpers.bench.cli import main

main()
