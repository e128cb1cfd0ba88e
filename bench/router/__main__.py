from bench.router.run import main

raise SystemExit(main())
