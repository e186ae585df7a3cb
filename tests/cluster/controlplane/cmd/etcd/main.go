// Command etcd is etcd's own server (go.etcd.io/etcd/server/v3/etcdmain) at the version Kubernetes pins,
// built in this module so the test control plane's store matches the API server's client.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}
