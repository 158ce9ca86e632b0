package agent

import (
	"encoding/base64"
	"encoding/json"
	"time"
)

// Resource types of the provider API. Each decodes tolerantly (numbers as
// strings, empty dates, unknown fields ignored) through an unexported wire
// struct; the json tags name the provider's fields for re-encoding.

// ClientRecord is a client of the account (endpoint 1).
type ClientRecord struct {
	ID    int    `json:"id"`
	Email string `json:"email"`
}

func (c *ClientRecord) UnmarshalJSON(b []byte) error {
	var w struct {
		ID    Int  `json:"id"`
		Email text `json:"email"`
	}
	if err := json.Unmarshal(b, &w); err != nil {
		return err
	}
	*c = ClientRecord{ID: int(w.ID), Email: string(w.Email)}
	return nil
}

// StatsItem is one day of usage of a ppr service (endpoint 2): requests or MB.
type StatsItem struct {
	Date Date    `json:"date"`
	Rate float64 `json:"rate"`
}

func (s *StatsItem) UnmarshalJSON(b []byte) error {
	var w struct {
		Date Date   `json:"date"`
		Rate Number `json:"rate"`
	}
	if err := json.Unmarshal(b, &w); err != nil {
		return err
	}
	*s = StatsItem{Date: w.Date, Rate: float64(w.Rate)}
	return nil
}

// RateItem is the usage and limit of a ppr service (endpoint 3): requests or MB.
type RateItem struct {
	Limit float64 `json:"limit"`
	Rate  float64 `json:"rate"`
}

func (r *RateItem) UnmarshalJSON(b []byte) error {
	var w struct {
		Limit Number `json:"limit"`
		Rate  Number `json:"rate"`
	}
	if err := json.Unmarshal(b, &w); err != nil {
		return err
	}
	*r = RateItem{Limit: float64(w.Limit), Rate: float64(w.Rate)}
	return nil
}

// ProductItem is an element of the product list (endpoints 6 and 7).
type ProductItem struct {
	ProductID   int     `json:"productId"`
	ProductName string  `json:"productName"`
	Price       float64 `json:"price"`
	GroupID     int     `json:"groupId"`
	GroupName   string  `json:"groupName"`
	CreatedAt   Date    `json:"created_at"`
}

type productItemWire struct {
	ProductID   Int    `json:"productId"`
	ProductName text   `json:"productName"`
	Price       Number `json:"price"`
	GroupID     Int    `json:"groupId"`
	GroupName   text   `json:"groupName"`
	CreatedAt   Date   `json:"created_at"`
}

func (w productItemWire) item() ProductItem {
	return ProductItem{ProductID: int(w.ProductID), ProductName: string(w.ProductName), Price: float64(w.Price),
		GroupID: int(w.GroupID), GroupName: string(w.GroupName), CreatedAt: w.CreatedAt}
}

func (p *ProductItem) UnmarshalJSON(b []byte) error {
	var w productItemWire
	if err := json.Unmarshal(b, &w); err != nil {
		return err
	}
	*p = w.item()
	return nil
}

// Product is a single product (endpoint 4). IPCount, UpdateTime and Geo are
// set for fpr products only; Geo is kept as the provider sent it, since the
// shape of its elements is not documented.
type Product struct {
	ProductItem
	ProductHidden bool            `json:"product_hidden"`
	GroupHidden   bool            `json:"group_hidden"`
	ProductType   string          `json:"product_type"` // "fpr" or "ppr"
	IPCount       int             `json:"ip_count"`
	UpdateTime    time.Time       `json:"update_time"` // UTC; zero if absent
	Geo           json.RawMessage `json:"geo,omitempty"`
}

func (p *Product) UnmarshalJSON(b []byte) error {
	var w struct {
		productItemWire
		ProductHidden flag            `json:"product_hidden"`
		GroupHidden   flag            `json:"group_hidden"`
		ProductType   text            `json:"product_type"`
		IPCount       Int             `json:"ip_count"`
		UpdateTime    timestamp       `json:"update_time"`
		Geo           json.RawMessage `json:"geo"`
	}
	if err := json.Unmarshal(b, &w); err != nil {
		return err
	}
	*p = Product{ProductItem: w.item(), ProductHidden: bool(w.ProductHidden), GroupHidden: bool(w.GroupHidden),
		ProductType: string(w.ProductType), IPCount: int(w.IPCount), UpdateTime: time.Time(w.UpdateTime), Geo: w.Geo}
	return nil
}

// OrderRequest is the body of an order (endpoint 5).
type OrderRequest struct {
	ClientID int    `json:"clientid"`
	SetIP    string `json:"setip,omitempty"` // IPv4 to bind; fpr only
}

// OrderResult is the answer to an order (endpoint 5).
type OrderResult struct {
	ServiceID int     `json:"serviceId"`
	OrderID   int     `json:"orderId"`
	InvoiceID int     `json:"invoiceId"`
	Amount    float64 `json:"amount"`
	IP        string  `json:"ip"`
}

func (o *OrderResult) UnmarshalJSON(b []byte) error {
	var w struct {
		ServiceID Int    `json:"serviceId"`
		OrderID   Int    `json:"orderId"`
		InvoiceID Int    `json:"invoiceId"`
		Amount    Number `json:"amount"`
		IP        text   `json:"ip"`
	}
	if err := json.Unmarshal(b, &w); err != nil {
		return err
	}
	*o = OrderResult{ServiceID: int(w.ServiceID), OrderID: int(w.OrderID), InvoiceID: int(w.InvoiceID),
		Amount: float64(w.Amount), IP: string(w.IP)}
	return nil
}

// Invoice is a billing invoice (endpoints 11 and 12).
type Invoice struct {
	ID            int     `json:"id"`
	Description   string  `json:"description"`
	Status        string  `json:"status"` // Unpaid, Paid, Cancelled, Refunded, Collections, Payment Pending, Pending
	CreatedAt     Date    `json:"created_at"`
	Amount        float64 `json:"amount"`
	DateRefunded  Date    `json:"date_refunded"`
	DatePaid      Date    `json:"date_paid"`
	PaymentMethod string  `json:"paymentmethod"`
	ServiceID     int     `json:"serviceid"`
}

func (v *Invoice) UnmarshalJSON(b []byte) error {
	var w struct {
		ID            Int    `json:"id"`
		Description   text   `json:"description"`
		Status        text   `json:"status"`
		CreatedAt     Date   `json:"created_at"`
		Amount        Number `json:"amount"`
		DateRefunded  Date   `json:"date_refunded"`
		DatePaid      Date   `json:"date_paid"`
		PaymentMethod text   `json:"paymentmethod"`
		ServiceID     Int    `json:"serviceid"`
	}
	if err := json.Unmarshal(b, &w); err != nil {
		return err
	}
	*v = Invoice{ID: int(w.ID), Description: string(w.Description), Status: string(w.Status), CreatedAt: w.CreatedAt,
		Amount: float64(w.Amount), DateRefunded: w.DateRefunded, DatePaid: w.DatePaid,
		PaymentMethod: string(w.PaymentMethod), ServiceID: int(w.ServiceID)}
	return nil
}

// Service is a single service (endpoint 13). BindedIP and IPCount are set
// for fpr services only.
type Service struct {
	ServiceID    int     `json:"service_id"`
	OrderID      int     `json:"orderid"`
	ProductName  string  `json:"product_name"`
	RegDate      Date    `json:"regdate"`
	NextDueDate  Date    `json:"nextduedate"`
	Status       string  `json:"status"`       // Active, Pending, Suspended, Terminated, Cancelled, Fraud
	BillingCycle string  `json:"billingcycle"` // Free, Monthly, Quarterly, Semi-Annually, Annually, Biennially, Triennially
	Username     string  `json:"username"`
	Password     string  `json:"password"`
	BindedIP     string  `json:"bindedip"`
	ProductType  string  `json:"product_type"` // "fpr" or "ppr"
	IPCount      int     `json:"ip_count"`
	Price        float64 `json:"price"`
}

func (s *Service) UnmarshalJSON(b []byte) error {
	var w struct {
		ServiceID    Int    `json:"service_id"`
		OrderID      Int    `json:"orderid"`
		ProductName  text   `json:"product_name"`
		RegDate      Date   `json:"regdate"`
		NextDueDate  Date   `json:"nextduedate"`
		Status       text   `json:"status"`
		BillingCycle text   `json:"billingcycle"`
		Username     text   `json:"username"`
		Password     text   `json:"password"`
		BindedIP     text   `json:"bindedip"`
		ProductType  text   `json:"product_type"`
		IPCount      Int    `json:"ip_count"`
		Price        Number `json:"price"`
	}
	if err := json.Unmarshal(b, &w); err != nil {
		return err
	}
	*s = Service{ServiceID: int(w.ServiceID), OrderID: int(w.OrderID), ProductName: string(w.ProductName),
		RegDate: w.RegDate, NextDueDate: w.NextDueDate, Status: string(w.Status), BillingCycle: string(w.BillingCycle),
		Username: string(w.Username), Password: string(w.Password), BindedIP: string(w.BindedIP),
		ProductType: string(w.ProductType), IPCount: int(w.IPCount), Price: float64(w.Price)}
	return nil
}

// ServiceItem is an element of the service list (endpoint 14).
type ServiceItem struct {
	ServiceID   int    `json:"service_id"`
	OrderID     int    `json:"orderid"`
	ProductName string `json:"product_name"`
	NextDueDate Date   `json:"nextduedate"`
	Status      string `json:"status"`
}

func (s *ServiceItem) UnmarshalJSON(b []byte) error {
	var w struct {
		ServiceID   Int  `json:"service_id"`
		OrderID     Int  `json:"orderid"`
		ProductName text `json:"product_name"`
		NextDueDate Date `json:"nextduedate"`
		Status      text `json:"status"`
	}
	if err := json.Unmarshal(b, &w); err != nil {
		return err
	}
	*s = ServiceItem{ServiceID: int(w.ServiceID), OrderID: int(w.OrderID), ProductName: string(w.ProductName),
		NextDueDate: w.NextDueDate, Status: string(w.Status)}
	return nil
}

// ServiceUpdate is the body of a service update (endpoint 15). Empty fields
// are not sent; an empty ServiceUpdate sends {}.
type ServiceUpdate struct {
	SetIP      string // IPv4 address to bind
	UpdateList bool   // request a new IP list (rate limited: ErrTooManyAttempts)
	Password   string // new proxy password in plain text; MarshalJSON base64-encodes it
}

// MarshalJSON writes the body the provider expects: string fields only,
// update_list as "true" and the password base64-encoded. Client.Call sends
// it as is, so a raw PUT builds the same body as UpdateService.
func (u ServiceUpdate) MarshalJSON() ([]byte, error) {
	body := map[string]string{}
	if u.SetIP != "" {
		body["setip"] = u.SetIP
	}
	if u.UpdateList {
		body["update_list"] = "true"
	}
	if u.Password != "" {
		body["password"] = base64.StdEncoding.EncodeToString([]byte(u.Password))
	}
	return json.Marshal(body)
}

// ServiceUpdateResult maps each performed action ("setip", "update_list",
// "password") to the provider's message, e.g. "IP list updated successfully".
type ServiceUpdateResult map[string]string

// Entry is one proxy of an IP list.
type Entry struct {
	Host     string // IP address or host name, IPv6 without brackets
	Port     int
	Login    string
	Password string
}

// IPList is a parsed IP list (endpoint 16). Lines or elements that could not
// be read are counted in Bad; the first few are kept in BadLines.
type IPList struct {
	Entries  []Entry
	Bad      int
	BadLines []string // at most MaxBadLines, each at most 200 bytes
	Raw      []byte   // the body as received
}

// StickySession is one sticky session of a ppr service (endpoint 17). The
// record's shape is undocumented; fields are read from common synonyms and
// every other field is kept in Extra.
type StickySession struct {
	Server  string // gateway host name: the {server} of rotate
	Session string // session id: the {session} of rotate
	Port    int    // the record's one port, whose protocol is not known
	// Ports are ports the record names per protocol ("http", "socks5"),
	// from http_port, socks_port or a ports object; nil if none.
	Ports  map[string]int
	ExitIP string
	TTL    int
	Extra  map[string]json.RawMessage
}

// StickyList is the sticky session list of a ppr service (endpoint 17).
// Elements that were neither objects nor strings are counted in Skipped.
type StickyList struct {
	Sessions []StickySession
	Skipped  int
	Raw      []byte
}

// StickyResult is the answer of rotate, changettl or resetall (endpoints
// 18-20), whose bodies are undocumented: Raw is the body as received, ExitIP
// the new exit IP when the body names one under a known key.
type StickyResult struct {
	Raw    []byte
	ExitIP string
}
