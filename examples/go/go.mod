// kreld-profiler: what a Go profiler does with kreld, through the bindings
// varlink/go's generator makes from kreld/io.kreld.varlink at build time.
//
// Built offline: the library is Debian's golang-github-varlink-go-dev, the
// source of varlink/go 0.4.0 under /usr/share/gocode (point the replace
// elsewhere with `go mod edit -replace` where it lives somewhere else).
module kreld.example/profiler

go 1.19

require github.com/varlink/go v0.4.0

replace github.com/varlink/go => /usr/share/gocode/src/github.com/varlink/go
