"""Writes tunebench's built-in sample: customer-support instruction -> response pairs.

Made from our own templates (no third-party text) so `tunebench train` runs offline out of the
box. Deterministic: `python -m tunebench.data.sample_gen` rewrites the shipped file byte for byte.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

OUT = Path(__file__).parent / "sample" / "customer_support.jsonl"
ROWS_PER_INTENT = 110

SLOTS = {
    "order": ["#A1042", "#B2291", "#C7720", "#D3318", "#E9054", "#F6603", "#G4187", "#H8810"],
    "item": ["wireless headphones", "running shoes", "coffee maker", "laptop stand", "yoga mat", "desk lamp",
             "phone case", "backpack", "water bottle", "bluetooth speaker"],
    "address": ["the new flat", "my office", "my parents' house", "a different city", "my new address"],
    "plan": ["Basic", "Plus", "Premium", "Family"],
    "method": ["credit card", "PayPal", "bank transfer", "debit card", "gift card"],
}

POLITE = ["", "Hi, ", "Hello, ", "Hey there, ", "Good morning, ", "Excuse me, "]
CLOSE = ["", " Thanks!", " Thank you.", " Please help.", " Can you help?", " Cheers."]

# intent: (category, instruction templates, response templates)
INTENTS: dict[str, tuple[str, list[str], list[str]]] = {
    "cancel_order": ("ORDER", [
        "i want to cancel order {order}", "how do I cancel my order {order}?",
        "please cancel the {item} I ordered", "can you help me cancel an order",
        "I changed my mind about order {order}, cancel it"], [
        "I can help you cancel order {order}. Go to Your Orders, select the order and choose Cancel Order. "
        "If it has not shipped yet, the cancellation is immediate and you will get a confirmation email.",
        "Sorry to hear you want to cancel. Open Your Orders, find the {item} and press Cancel. "
        "Orders that have already shipped can be returned instead once they arrive."]),
    "change_order": ("ORDER", [
        "I need to change the {item} in my order", "can I modify order {order}?",
        "how do I add an item to order {order}", "I ordered the wrong size, can I change it?"], [
        "You can change order {order} while it is still processing. Open Your Orders, select Edit Order "
        "and update the items. Once it ships, changes are no longer possible, but you can return it.",
        "Happy to help with that. Orders can be edited from Your Orders until they are packed. "
        "Choose the order, press Edit and swap the {item} for the one you need."]),
    "track_order": ("ORDER", [
        "where is my order {order}?", "track order {order}", "how can I see where my {item} is",
        "my order {order} has not arrived, where is it"], [
        "You can track order {order} from Your Orders: the tracking link shows where the parcel is and "
        "the expected delivery date. Tracking updates can take up to 24 hours after shipping.",
        "Let me help you find your {item}. Open Your Orders and press Track Package to see the latest "
        "scan and the estimated delivery date."]),
    "place_order": ("ORDER", [
        "how do I buy a {item}?", "I want to place an order", "help me order a {item}",
        "what is the way to purchase something"], [
        "To place an order, add the {item} to your cart, open the cart and press Checkout. Choose an "
        "address and a payment method, then confirm. You will get an email with the order number.",
        "Ordering is easy: find the {item}, choose Add to Cart, then Checkout. Review the address and "
        "payment, and press Place Order."]),
    "shipping_address": ("SHIPPING", [
        "I need to change my shipping address", "can you ship order {order} to {address}?",
        "how do I update the delivery address", "my address is wrong on order {order}"], [
        "You can change the shipping address of order {order} from Your Orders before it ships: choose "
        "Change Address and enter the new one. For future orders, update it under Account > Addresses.",
        "To ship to {address}, open Account > Addresses and add it, then select it at checkout. An order "
        "that has not shipped can be redirected from Your Orders."]),
    "delivery_options": ("DELIVERY", [
        "what delivery options do you have?", "do you offer express shipping", "how fast can you deliver a {item}",
        "is next day delivery available"], [
        "We offer standard delivery (3-5 working days), express (1-2 working days) and next-day delivery "
        "in most areas. The options and prices for your address are shown at checkout.",
        "For the {item} you can choose standard, express or next-day delivery. Checkout shows which ones "
        "reach your address and what they cost."]),
    "delivery_period": ("DELIVERY", [
        "how long does delivery take?", "when will my {item} arrive", "when should order {order} arrive",
        "what is the delivery time to {address}"], [
        "Standard delivery takes 3-5 working days and express 1-2. The expected date for order {order} "
        "is in Your Orders and in your confirmation email.",
        "Most parcels arrive within 3-5 working days. You can check the estimated date for your {item} "
        "under Your Orders."]),
    "get_refund": ("REFUND", [
        "I want a refund for order {order}", "how do I get my money back for the {item}",
        "can I get a refund", "refund my order please"], [
        "I can help with a refund for order {order}. Start a return from Your Orders; once we receive the "
        "{item}, the refund goes to your original payment method within 5-7 working days.",
        "To get a refund, open Your Orders, choose Return or Refund and follow the steps. Refunds are "
        "issued to the {method} you paid with."]),
    "track_refund": ("REFUND", [
        "where is my refund?", "I haven't received my refund for order {order}", "check my refund status",
        "how long does a refund take"], [
        "Refunds are processed within 2 working days of the return arriving and reach your {method} in "
        "5-7 working days. You can follow the status of order {order} under Your Orders > Returns.",
        "Let me check that for you: the refund status is shown under Your Orders > Returns. If it has "
        "been more than 10 working days, reply here and we will look into it."]),
    "refund_policy": ("REFUND", [
        "what is your refund policy?", "can I return a {item} after 30 days", "do you refund opened items",
        "explain the return policy"], [
        "You can return most items within 30 days of delivery for a full refund, as long as they are in "
        "their original condition. Opened electronics can be returned if they are faulty.",
        "Our policy allows returns within 30 days. The {item} must be unused and in its packaging; the "
        "refund goes back to your original payment method."]),
    "create_account": ("ACCOUNT", [
        "how do I create an account?", "I want to sign up", "open a new account for me",
        "can I register with my email"], [
        "To create an account, press Sign Up at the top of the page, enter your email and a password, "
        "and confirm the link we send you. It takes less than a minute.",
        "Welcome! Choose Sign Up, fill in your name, email and password, then verify your email address. "
        "You can then save addresses and track orders."]),
    "delete_account": ("ACCOUNT", [
        "please delete my account", "how do I close my account?", "I want to remove my profile",
        "delete all my data"], [
        "I'm sorry to see you go. You can close your account under Account > Settings > Close Account. "
        "Open orders must be completed first; your data is deleted within 30 days.",
        "To delete your account, open Account > Settings and choose Close Account. We will email you a "
        "confirmation once your data has been removed."]),
    "recover_password": ("ACCOUNT", [
        "I forgot my password", "how do I reset my password?", "I can't log in to my account",
        "help me recover my account"], [
        "No problem. Press Forgot Password on the sign-in page and enter your email. We will send a link "
        "to set a new password; it is valid for one hour.",
        "You can reset your password from the sign-in page with Forgot Password. If the email does not "
        "arrive, check your spam folder or contact us again."]),
    "edit_account": ("ACCOUNT", [
        "how can I change my email address?", "I need to update my account details", "change my phone number",
        "edit my profile information"], [
        "You can update your email, phone number and name under Account > Profile. Changes to the email "
        "address are confirmed by a link sent to the new address.",
        "Open Account > Profile, press Edit, update the details and save. Your next orders will use the "
        "new information."]),
    "payment_methods": ("PAYMENT", [
        "what payment methods do you accept?", "can I pay with {method}?", "do you take {method}",
        "which ways can I pay"], [
        "We accept credit and debit cards, PayPal, bank transfer and gift cards. You can choose the "
        "payment method at checkout.",
        "Yes, {method} is accepted, along with cards, PayPal and gift cards. Pick it on the payment step "
        "of checkout."]),
    "payment_issue": ("PAYMENT", [
        "my payment was declined", "I was charged twice for order {order}", "there is a problem with my {method}",
        "why did my payment fail"], [
        "Sorry about the trouble with your payment. A declined {method} is usually caused by a wrong "
        "billing address or a bank limit. Check the details or try another method.",
        "If you were charged twice for order {order}, the extra charge is normally a hold that your bank "
        "releases within 3-5 working days. If it stays, send us the statement and we will refund it."]),
    "get_invoice": ("INVOICE", [
        "I need an invoice for order {order}", "where can I download my invoice?", "send me the bill for my {item}",
        "how do I get a receipt"], [
        "You can download the invoice for order {order} from Your Orders: open the order and press "
        "Download Invoice. It is a PDF you can print or forward.",
        "Invoices are available for every order under Your Orders > Invoice. We can also email it to you "
        "if you reply with the order number."]),
    "contact_human_agent": ("CONTACT", [
        "I want to talk to a person", "connect me with a human agent", "can I speak to someone?",
        "I need a real agent, not a bot"], [
        "Of course. You can reach our team by phone from 9am to 6pm on working days, or press Chat with "
        "an Agent in the Help Center and the next free agent will join.",
        "I'll connect you with an agent. Please stay in this chat; the average waiting time right now is "
        "under five minutes."]),
    "complaint": ("FEEDBACK", [
        "I want to file a complaint", "your service was terrible", "I am unhappy with my {item}",
        "how do I complain about order {order}"], [
        "I'm sorry about your experience. Please tell us what happened with order {order}; we read every "
        "complaint and will answer within 2 working days.",
        "Thank you for telling us, and I'm sorry the {item} let you down. You can file a complaint in the "
        "Help Center under Feedback, or describe it here and I will pass it on."]),
    "newsletter_subscription": ("SUBSCRIPTION", [
        "how do I unsubscribe from the newsletter?", "sign me up for your newsletter", "stop sending me emails",
        "I want to change my {plan} subscription"], [
        "You can manage the newsletter under Account > Notifications: switch it on or off at any time. "
        "Every email also has an Unsubscribe link at the bottom.",
        "Your {plan} subscription can be changed or cancelled under Account > Subscriptions. Changes take "
        "effect at the start of the next billing period."]),
}


def rows(seed: int = 0) -> list[dict[str, str]]:
    rng = random.Random(seed)
    out = []
    for intent, (category, asks, answers) in INTENTS.items():
        for _ in range(ROWS_PER_INTENT):
            slots = {k: rng.choice(v) for k, v in SLOTS.items()}
            ask = rng.choice(asks).format(**slots)
            ask = rng.choice(POLITE) + ask + rng.choice(CLOSE)
            if rng.random() < 0.3:
                ask = ask.lower()
            out.append({"instruction": ask.strip(), "response": rng.choice(answers).format(**slots),
                        "intent": intent, "category": category})
    rng.shuffle(out)
    return out


def render(seed: int = 0) -> str:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows(seed))


if __name__ == "__main__":
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(render(), encoding="utf-8")
    print(f"wrote {len(rows())} rows to {OUT}")
