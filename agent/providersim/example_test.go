package providersim_test

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"

	"github.com/proxyd/proxyd/agent/providersim"
)

// A simulator whose http-auth list points at a local upstream proxy.
func Example() {
	sim := providersim.New(providersim.Config{Layout: providersim.Layout{TXT: providersim.TXTLoginFirst}})
	sim.SetEntries(providersim.ServiceStatic, "http-auth", []providersim.Entry{
		{Host: "127.0.0.1", Port: 3128, Login: "alice", Password: "secret"},
	})
	srv := httptest.NewServer(sim)
	defer srv.Close()

	req, err := http.NewRequest("GET", srv.URL+"/api/iplist/http-auth/txt/101", nil)
	if err != nil {
		panic(err)
	}
	req.Header.Set("Authorization", "Basic "+providersim.DefaultToken)
	resp, err := srv.Client().Do(req)
	if err != nil {
		panic(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	fmt.Printf("%d %q\n", resp.StatusCode, body)
	fmt.Println(sim.Requests("/api/iplist/{typel}/{formatl}/{id}"))
	// Output:
	// 200 "alice:secret@127.0.0.1:3128\n"
	// 1
}

// The default world's rotating gateway: records name it by host name with
// the session's HTTP port, the lists name it by IP with HTTP and SOCKS5
// ports apart, and LookupHost says which IP the name stands for.
func ExampleSim_LookupHost() {
	sim := providersim.New(providersim.Config{Layout: providersim.Layout{StickyPorts: providersim.StickyPortSplit}})
	srv := httptest.NewServer(sim)
	defer srv.Close()
	get := func(path string) string {
		req, err := http.NewRequest("GET", srv.URL+path, nil)
		if err != nil {
			panic(err)
		}
		req.Header.Set("Authorization", "Basic "+providersim.DefaultToken)
		resp, err := srv.Client().Do(req)
		if err != nil {
			panic(err)
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		return string(body)
	}
	fmt.Println(get("/api/sticky/list/102"))
	fmt.Print(get("/api/iplist/ppr-http/txt/102"))
	fmt.Print(get("/api/iplist/ppr-socks/txt/102"))
	addrs, err := sim.LookupHost(context.Background(), providersim.StickyGateway)
	fmt.Println(addrs, err)
	// Output:
	// [{"server":"gw1.sim.example","session":"s1","http_port":10001,"socks_port":2087,"ip":"198.51.100.1","ttl":5},{"server":"gw1.sim.example","session":"s2","http_port":10002,"socks_port":2087,"ip":"198.51.100.2","ttl":5}]
	// 192.0.2.21:10001@u102:pw-102-sim
	// 192.0.2.21:10002@u102:pw-102-sim
	// 192.0.2.21:2087@u102:pw-102-sim
	// [192.0.2.21] <nil>
}
