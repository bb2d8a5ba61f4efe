from kimi_perf.cli import main

main()
