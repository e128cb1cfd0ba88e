from bench.nixl_release.run import main

main()
