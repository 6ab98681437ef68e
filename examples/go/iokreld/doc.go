// Package iokreld is the io.kreld interface as varlink/go's generator makes it:
// `go generate` in examples/go copies kreld/io.kreld.varlink here and writes
// iokreld.go beside it (neither is committed: the bindings are always those of
// the interface in this checkout).
package iokreld
