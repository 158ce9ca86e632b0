package providersim_test

import (
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
