from rollstream.cli import main

raise SystemExit(main())
