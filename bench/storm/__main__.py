from bench.storm.run import main

raise SystemExit(main())
